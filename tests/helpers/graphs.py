"""A CPU stand-in for captured decode and verify CUDA graphs."""

import torch

from backend.engine.runner.cuda_graphs import DecodeGraphs, graph_ladders
from backend.engine.runner.step_inputs import static_decode_inputs


class EagerReplayGraphs(DecodeGraphs):
    """Stands in for captured graphs on CPU: a replay recomputes the forward pass over the
    static views a capture would have recorded (fixed buffers, full-width block tables,
    fixed split-KV, every padded row's logits), so everything but the CUDA graph
    machinery itself is exercised. verify_query_len > 1 adds the verify ladder."""

    def __init__(self, runner, max_num_seqs, splits=2, verify_query_len=0):
        ladders = graph_ladders(max_num_seqs, verify_query_len, runner.inputs.T)
        super().__init__(ladders.sizes, ladders.verify_sizes, ladders.verify_query_len)
        self.runner, self.splits, self.replayed = runner, splits, []
        self._out = None
        self._hidden = None

    def replay(self, shape):
        m, step = self.runner.model, static_decode_inputs(self.runner.inputs, shape, self.splits)
        self.replayed.append(shape)
        logits = m.compute_logits(m(step.input_ids, step.positions, self.runner.kv_caches, step.meta))
        # Into one buffer that every replay overwrites, as graphs sharing a memory pool may:
        # a caller still holding the logits of an earlier replay reads another's.
        if self._out is None or self._out.shape[0] < logits.shape[0] or self._out.shape[1:] != logits.shape[1:]:
            self._out = torch.empty((max(logits.shape[0], 64), *logits.shape[1:]), dtype=logits.dtype)
        out = self._out[:logits.shape[0]]
        out.copy_(logits)
        # What the forward left for a drafter (CausalLM.captured_hidden, an EAGLE head's
        # output): a buffer every replay overwrites too, as a graph's static output is.
        hidden = getattr(m, "captured_hidden", None)
        if hidden is not None:
            if self._hidden is None or self._hidden.shape[0] < hidden.shape[0] or \
                    self._hidden.shape[1:] != hidden.shape[1:]:
                self._hidden = torch.empty((max(hidden.shape[0], 64), *hidden.shape[1:]), dtype=hidden.dtype)
            self.hidden[shape] = self._hidden[:hidden.shape[0]]
            self.hidden[shape].copy_(hidden)
        return out
