"""Medusa proposals (vLLM's `method: "medusa"`): heads on the target's final hidden state
(backend/models/medusa.py) guess the next k tokens at once.

Inside the runner's step, like a draft model (the scheduler reserves the lookahead slots
the same way, and they hold the verification's K/V next step): for each request that
proposes, the target's final hidden state at its last computed position (the accepted
one, after a verification) is read from what the target's forward captured, and head i
gives proposal i + 1, drawn under the request's sampling settings (argmax when greedy)
with its distribution for the rejection sampler. Nothing is kept per request and nothing
is written to the KV cache. With a tree of proposals, head i's top-k gives the nodes at
depth i + 1 (tree_drafting.py).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.sampling.sampler import Sampler
from backend.engine.spec_decode.draft_model import draw_proposals, rows_after_step
from backend.engine.spec_decode.draft_tokens import DraftTokens
from backend.engine.spec_decode.proposals import Proposals
from backend.engine.spec_decode.token_tree import TokenTree
from backend.engine.spec_decode.tree_drafting import hand_over, medusa_plan, top_candidates


class MedusaProposer:
    in_runner = True
    reads_target_hidden = True

    def __init__(self, heads, block_size: int, sampler: Sampler, vocab_size: int,
                 device: torch.device, tree: Optional[TokenTree] = None) -> None:
        self.heads = heads
        self.block_size = block_size
        self.sampler = sampler
        self.vocab_size = vocab_size
        self._rows = GrowingStagedBuffer(torch.int64, device)
        self._tree_index = GrowingStagedBuffer(torch.int64, device)
        self.tree = tree

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, verify_query_len: int) -> None:
        """Nothing to capture: a few GEMMs over the proposing rows."""

    def forget(self, request_ids) -> None:
        """Nothing is kept per request."""

    @torch.inference_mode()
    def propose(self, sched, states, sampled_token_ids: list[list[int]], target_hidden: Optional[torch.Tensor] = None,
                paths: Optional[dict[int, list[int]]] = None) -> Proposals:
        proposing = [row for row in rows_after_step(sched, states, sampled_token_ids, self.block_size, paths, self.tree)
                     if row.k > 0]
        if not proposing:
            return Proposals()
        if target_hidden is None:
            raise RuntimeError("Medusa heads need the target's hidden states of the step")
        last = np.concatenate([row.hidden_rows(row.num_computed - 1, row.num_computed) for row in proposing])
        hidden = target_hidden.index_select(0, self._rows.upload(last))
        if self.tree is not None:
            return Proposals(self._tree(proposing, hidden))
        k = min(max(row.k for row in proposing), self.heads.num_heads)
        requests = [row.as_sampled for row in proposing]
        drawn = [draw_proposals(self.sampler, self.heads.logits(i, hidden), requests, self.vocab_size)
                 for i in range(k)]
        flat = torch.stack([t for t, _ in drawn], dim=1).reshape(-1)      # [rows x k], row-major
        out, read = {}, [None]          # (read: one host copy for all, if ever read)
        for r, row in enumerate(proposing):
            n = min(row.k, k)
            q = None
            if not row.state.sampling_params.greedy:
                q = torch.stack([drawn[i][1][r] for i in range(n)])
            out[row.state.request_id] = (DraftTokens(flat, r * k, n, read), q)
        return Proposals(out)


    def _tree(self, proposing, hidden: torch.Tensor) -> dict:
        tree = self.tree
        tops = torch.stack([top_candidates(self.heads.logits(d, hidden), tree.max_children, self.vocab_size)
                            for d in range(tree.depth)])
        index = self._tree_index.upload(medusa_plan(tree, len(proposing)))
        table = tops.reshape(-1).index_select(0, index).view(len(proposing), tree.num_nodes)
        return hand_over([row.state.request_id for row in proposing], table, [row.k for row in proposing])


def load_medusa(spec, target, dtype: torch.dtype, device: torch.device):
    """The heads `spec` (SpeculativeConfig) names, with the target set to capture its final
    hidden states."""
    from backend.config import ConfigError
    from backend.models.medusa import load_medusa_heads
    heads = load_medusa_heads(spec.model, target, dtype, device)
    tree = spec.token_tree
    if (tree.depth if tree is not None else spec.num_speculative_tokens) > heads.num_heads:
        what = (f"'speculative_config.speculative_token_tree': its {tree.depth} levels" if tree is not None else
                f"'speculative_config.num_speculative_tokens': {spec.num_speculative_tokens} proposals")
        raise ConfigError(f"invalid engine argument {what} need as many Medusa heads; '{spec.model}' has "
                          f"{heads.num_heads}")
    target.capture_final_hidden = True
    return heads
