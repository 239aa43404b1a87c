"""A CPU stand-in for captured decode CUDA graphs."""

from backend.engine.cuda_graphs import DecodeGraphs, capture_sizes
from backend.engine.step_inputs import static_decode_inputs


class EagerReplayGraphs(DecodeGraphs):
    """Stands in for captured graphs on CPU: a replay recomputes the forward pass over the
    static views a capture would have recorded (fixed buffers, full-width block tables,
    fixed split-KV), so everything but the CUDA graph machinery itself is exercised."""

    def __init__(self, runner, max_num_seqs, splits=2):
        super().__init__(capture_sizes(max_num_seqs))
        self.runner, self.splits, self.replayed = runner, splits, []

    def replay(self, size):
        m, step = self.runner.model, static_decode_inputs(self.runner.inputs, size, self.splits)
        self.replayed.append(size)
        return m.compute_logits(m(step.input_ids, step.positions, self.runner.kv_caches, step.meta))
