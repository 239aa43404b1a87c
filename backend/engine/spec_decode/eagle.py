"""EAGLE proposals (vLLM's `method: "eagle3"` and `"eagle"`): a one-layer head drafts
from the target's own hidden states (backend/models/eagle3.py, eagle1.py): EAGLE-3 from
the residual stream entering three of the target's layers, EAGLE-1 from its final
hidden state.

It runs where a draft model runs, inside the runner's step, and is a DraftModelProposer
in everything but its inputs:
- Catch-up: for every position p the target computed in the step (a prompt chunk, or a
  verification's accepted tokens), the head reads token p + 1 and the target's
  residual stream at p (the three layers' inputs, fused by the head's `fc`), and writes
  its K/V at p (the head's `combine` makes its hidden input of the target's). So its
  last catch-up position is the one before the newest token, and
  the newest token is its input there (`lag` 2). The target's rows come from the step
  that just ran (ModelRunner keeps what its forward captured), so the head never runs
  behind: positions the target did not compute in a step (a prefix-cache hit) keep the
  head K/V that whoever computed them wrote.
- Proposals 2..k: each forward reads the previous proposal and the head's own output
  (its residual stream before the final norm) at the position before.
- Its logits score the head's draft vocabulary; they are scattered into the target's
  (d2t) before the draw, so proposals and their distributions are in target ids.

With a tree of proposals (`speculative_token_tree`), the catch-up's top-k gives the
first level and one forward per level the next (tree_drafting.py); after a tree's
verification the catch-up reads the target's rows of the accepted nodes.

A prefix hit's last position per block was written with the next token of the request
that computed it, which may differ from this request's: a stale entry lowers the
acceptance rate, never the output's correctness (the target verifies every proposal).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.spec_decode.draft_model import DraftModelProposer, _Row, plain_greedy
from backend.engine.spec_decode.proposals import Proposals
from backend.engine.spec_decode.rejection_sampler import VerifyRow
from backend.engine.spec_decode.token_tree import TokenTree
from backend.engine.spec_decode.tree_drafting import hand_over, level_plan, top_candidates
from backend.ops.cpu_argmax import argmax_rows


class EagleProposer(DraftModelProposer):
    lag = 2
    reads_target_hidden = True

    def __init__(self, head, kv_caches, block_size: int, inputs, sampler, vocab_size: int,
                 tree: Optional[TokenTree] = None) -> None:
        super().__init__(head, kv_caches, block_size, inputs, sampler, vocab_size)
        self.tree = tree
        head.allocate_hidden_input(inputs.T)
        self._rows = GrowingStagedBuffer(torch.int64, self.device)
        # (a tree's indices: a buffer of their own, so that their upload does not wait for
        # the catch-up's, which the device reads after the next step's forward)
        self._tree_index = GrowingStagedBuffer(torch.int64, self.device)
        self._carry: Optional[torch.Tensor] = None       # the last forward's sampled rows' head output
        self._to_target = head.draft_to_target     # (None: the head scores the target's vocabulary)

    def _catch_up(self, rows: list[_Row], target_hidden: Optional[torch.Tensor] = None, draw: bool = True):
        segments = [(row, row.step_start, row.num_computed) for row in rows if row.num_computed > row.step_start]
        if not segments:
            return None
        if target_hidden is None:
            raise RuntimeError("an EAGLE head needs the target's hidden states of the step")
        index = self._rows.upload(np.concatenate([row.hidden_rows(a, b) for row, a, b in segments]))
        hidden = self.model.combine(target_hidden.index_select(0, index))
        logits = self._forward(
            [row.state for row, _, _ in segments], np.asarray([a for _, a, _ in segments], dtype=np.int64),
            np.asarray([b - a for _, a, b in segments], dtype=np.int64),
            np.asarray([int(row.k > 0) for row, _, _ in segments], dtype=np.int64),
            lambda i, a, b: segments[i][0].token_slice(a + 1, b + 1), hidden=hidden)
        for row, _, end in segments:
            row.state.num_draft_computed = end
        if logits is None or not draw:
            return logits
        return self._draw(logits, [row.as_sampled for row, _, _ in segments if row.k > 0])

    def _propose_tree(self, rows: list[_Row], target_hidden: Optional[torch.Tensor]) -> Proposals:
        """Each proposing request's first k nodes of the tree (tree_drafting.py)."""
        logits = self._catch_up(rows, target_hidden, draw=False)
        proposing = [row for row in rows if row.k > 0]
        if logits is None:
            return Proposals()
        tree, ks = self.tree, [row.k for row in proposing]
        kmax = tree.max_children
        index, first_fill, levels = level_plan(tree, ks)
        index = self._tree_index.upload(index)
        table = torch.zeros(len(proposing), tree.num_nodes, dtype=torch.int64, device=self.device)
        flat = table.view(-1)
        top = top_candidates(logits, kmax, self.vocab_size, self._to_target).reshape(-1)
        flat.index_copy_(0, index[first_fill[0]], top.index_select(0, index[first_fill[1]]))
        for level in levels:
            active = [proposing[r] for r in level.active]
            newest = np.asarray([row.num_tokens - 1 for row in active], dtype=np.int64)    # (the head's tree start)
            width = np.full(len(active), level.width, dtype=np.int64)
            logits = self._forward([row.state for row in active], newest + level.first, width, width,
                                   lambda i, a, b: [0] * (b - a), flat.index_select(0, index[level.inputs]),
                                   index[level.kept],
                                   trees=[(i, int(newest[i]), tree.prefix(row.k)) for i, row in enumerate(active)])
            top = top_candidates(logits, kmax, self.vocab_size, self._to_target).reshape(-1)
            flat.index_copy_(0, index[level.fill[0]], top.index_select(0, index[level.fill[1]]))
        return Proposals(hand_over([row.state.request_id for row in proposing], table, ks))

    def _forward(self, states, starts, n_new, num_rows, tokens, input_ids=None, kept=None,
                 hidden: Optional[torch.Tensor] = None, trees=None) -> Optional[torch.Tensor]:
        """DraftModelProposer._forward, with each row's hidden input: `hidden` (catch-up),
        else the previous forward's output at the rows `kept`."""
        if hidden is None:
            hidden = self._carry if kept is None else self._carry.index_select(0, kept)
        self.model.hidden_in[:hidden.shape[0]].copy_(hidden)
        return super()._forward(states, starts, n_new, num_rows, tokens, input_ids, kept, trees)

    def _run(self, step, shape) -> Optional[torch.Tensor]:
        logits = super()._run(step, shape)
        if step.num_logits:
            out = self.graphs.hidden[shape] if shape is not None else self.model.captured_hidden
            self._carry = out.index_select(0, step.logits_indices[:step.num_logits])
        return logits

    def _draw(self, logits: torch.Tensor, requests: list[VerifyRow]):
        if self._to_target is not None:
            if all(plain_greedy(r, self.vocab_size) for r in requests):
                return self._to_target[argmax_rows(logits)], None      # (no scatter into the target's vocabulary)
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, self._to_target] = logits
            logits = full
        return super()._draw(logits, requests)


def load_eagle(method: str, path: str, target, dtype: torch.dtype, device: torch.device, attention_backend: str,
               max_position: int):
    """(the head, its layers' ModelConfig), with the target set to capture what the head
    reads: the layer inputs an EAGLE-3 head names, the final hidden states for EAGLE-1."""
    from backend.attention import make_attention_factory
    from backend.models.eagle1 import load_eagle1_head
    from backend.models.eagle3 import load_eagle3_head
    from backend.ops import make_layer_ops
    factory, ops = make_attention_factory(attention_backend), make_layer_ops(attention_backend)
    if method == "eagle3":
        head, cfg, layers = load_eagle3_head(path, target, factory, ops, dtype, device, max_position)
    else:
        head, cfg = load_eagle1_head(path, target, factory, ops, dtype, device, max_position)
    if method == "eagle3":
        target.aux_hidden_layers = frozenset(layers)
    else:
        target.capture_final_hidden = True
    return head, cfg
