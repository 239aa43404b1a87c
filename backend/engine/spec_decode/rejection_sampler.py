"""Verification of proposed tokens, batched over every row the step scores.

A request verifying k proposals has k + 1 logits rows: row j scores the token after its
j-th proposal. Row j is sampled as decoding would sample it one token at a time: its
penalties and min_tokens see the request's output plus proposals 1..j (VerifyRow), and
its seeded draws come from the request's generator.

The rule (Leviathan et al. 2023; Chen et al. 2023), per row j with proposal d drawn from
q: greedy rows accept d when it is the target's argmax; sampled rows accept with
probability min(1, p(d) / q(d)). The first rejected row emits a token drawn from the
normalised residual max(0, p - q), and when all k are accepted the last row emits a
bonus token drawn from p. An n-gram proposal is a point mass: q(d) = 1. The output is
distributed exactly as p, whatever q is.

A tree of proposals (token_tree.py) has a row for its root and one per node, each
drawn as decoding draws (the node's row after the node's path); a node stands when its
token equals its parent's draw, and the host walks from the root along standing nodes.

Everything runs on the logits' device; the host learns the outcome from the step's one
device-to-host copy (each row's proposal and accept flag beside the tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.sampling.sampler import TEMPERATURE, Sampler, SamplingBatch
from backend.engine.spec_decode.draft_tokens import DraftTokens, device_fill, extend_staged
from backend.engine.spec_decode.token_tree import TokenTree
from backend.ops.cpu_argmax import argmax_rows

# Row kinds in the verification plan. PLAIN: the one row of a request that verifies
# nothing, drawn exactly as the plain sampler draws it (the same random numbers from a
# seeded request's generator), so its tokens do not depend on who else speculates.
BONUS, POINT, DRAWN, PLAIN = 0, 1, 2, 3


class VerifyRow:
    """A request's state as its logits row after `proposed` tokens sees it: those tokens count as
    output, as they would when decoding one token at a time. The sampler reads the
    request's own penalty state plus `proposed` (nothing is copied per row)."""
    __slots__ = ("verified_request", "proposed", "sampling_params", "sampling_row", "generator", "bad_words",
                 "eos_token_ids")

    def __init__(self, request, proposed: Sequence[int]) -> None:
        self.verified_request = request
        self.proposed = proposed
        # What the sampler reads of every row, copied (fixed for the request's life):
        # read through __getattr__ they would cost a failed lookup each.
        self.sampling_params = request.sampling_params
        self.sampling_row = request.sampling_row
        self.generator = request.generator
        self.bad_words = request.bad_words
        self.eos_token_ids = request.eos_token_ids

    def __getattr__(self, name: str):
        return getattr(self.verified_request, name)

    @property
    def output_token_ids(self) -> list[int]:
        return self.verified_request.output_token_ids + list(self.proposed)

    @property
    def all_token_ids(self) -> list[int]:
        return self.verified_request.all_token_ids + list(self.proposed)

    @property
    def num_output_tokens(self) -> int:
        return self.verified_request.num_output_tokens + len(self.proposed)

    def output_tail(self, k: int) -> list[int]:
        """The last k tokens of the output this row sees, without building all of it."""
        proposed = self.proposed
        if len(proposed) >= k:
            return list(proposed[len(proposed) - k:])
        return self.verified_request.output_tail(k - len(proposed)) + list(proposed)


def verify_rows(scheduled: Sequence, states: Sequence, tree: Optional[TokenTree] = None) -> list:
    """One sampler row per logits row: k + 1 per request verifying k proposals (a tree's:
    its root, then each node after the node's path). `states`: each scheduled request's
    state (runner/request_state.py)."""
    rows: list = []
    for s, state in zip(scheduled, states):
        spec = s.spec_token_ids
        if tree is not None and spec:
            rows.append(state)
            rows.extend(VerifyRow(state, path_tokens(spec, tree.path_of(j))) for j in range(len(spec)))
            continue
        rows.extend(VerifyRow(state, spec[:j]) if j else state for j in range(len(spec) + 1))
    return rows


def path_tokens(spec: Sequence[int], path: list[int]) -> Sequence[int]:
    """The proposals along a path of nodes (left on the device if they are there)."""
    return spec.take(path) if isinstance(spec, DraftTokens) else [spec[j] for j in path]


@dataclass
class VerifyPlan:
    proposals: torch.Tensor         # int64 [R]: the row's proposal, -1 on bonus rows
    kinds: torch.Tensor             # int64 [R]: BONUS, POINT, DRAWN or PLAIN
    drawn_rows: torch.Tensor        # int64 [N]: rows whose proposal was drawn from a draft distribution
    draft_probs: list[torch.Tensor]  # those distributions, [k_i, V] per request, rows in order
    plain_rows: frozenset[int] = frozenset()    # host side: the PLAIN rows
    # A tree's verification: each row's parent row (its own for a root), and proposals
    # holding each node's own token at its row (-1 at roots).
    parent_rows: Optional[torch.Tensor] = None


class RejectionSampler:
    def __init__(self, device: torch.device) -> None:
        self._plan = GrowingStagedBuffer(torch.int64, device)
        self._draft_index = GrowingStagedBuffer(torch.int64, device)

    def plan(self, scheduled: Sequence, tree: Optional[TokenTree] = None) -> VerifyPlan:
        """Each row's proposal and kind, in one upload; a draft model's proposals, on the
        device (draft_tokens.py), written into the plan there."""
        if tree is not None:
            return self._plan_tree(scheduled, tree)
        proposals, kinds, drawn, probs, plain = [], [], [], [], []
        on_device: list[tuple[int, DraftTokens]] = []
        for s in scheduled:
            spec = s.spec_token_ids
            drawn_from_draft = s.draft_probs is not None
            if drawn_from_draft:
                drawn.extend(range(len(proposals), len(proposals) + len(spec)))
                probs.append(s.draft_probs)
            if not spec:
                plain.append(len(proposals))
            extend_staged(proposals, spec, on_device)
            proposals.append(-1)
            kinds += [DRAWN if drawn_from_draft else POINT] * len(spec) + [BONUS if spec else PLAIN]
        R = len(proposals)
        dev = self._plan.upload(np.asarray(proposals + kinds + drawn, dtype=np.int64))
        device_fill(dev[:R], on_device, self._draft_index)
        return VerifyPlan(dev[:R], dev[R:2 * R], dev[2 * R:], probs, frozenset(plain))

    def _plan_tree(self, scheduled: Sequence, tree: TokenTree) -> VerifyPlan:
        proposals: list[int] = []
        parents: list[int] = []
        on_device: list[tuple[int, DraftTokens]] = []
        for s in scheduled:
            root = len(proposals)
            proposals.append(-1)
            parents.append(root)
            if s.spec_token_ids:
                extend_staged(proposals, s.spec_token_ids, on_device)
                parents.extend((root + 1 + tree.parents[:len(s.spec_token_ids)]).tolist())
        R = len(proposals)
        dev = self._plan.upload(np.asarray(proposals + parents, dtype=np.int64))
        device_fill(dev[:R], on_device, self._draft_index)
        return VerifyPlan(dev[:R], dev[:0], dev[:0], [], parent_rows=dev[R:])

    def sample(self, sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch, plan: VerifyPlan
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's token [R]: the target's choice there if the row is reached, bool
        accepted [R]: whether the row's proposal stands). A request's output is its
        leading accepted proposals and then the token of its first non-accepted row (on
        a tree: the standing path from the root, then its last node's row's token)."""
        if plan.parent_rows is not None:
            # Every row drawn as decoding draws it; a node stands where its parent drew it.
            sampled = sampler.sample(logits, batch)
            return sampled, (sampled.index_select(0, plan.parent_rows) == plan.proposals) & (plan.proposals >= 0)
        logits, probs = sampler.distributions(logits, batch)
        target = argmax_rows(logits)
        proposals = plan.proposals
        is_proposal = proposals >= 0
        safe = proposals.clamp(min=0)[:, None]
        greedy_accept = (target == proposals) & is_proposal
        if probs is None:                       # every row greedy
            return target, greedy_accept
        raw = probs
        probs = probs / probs.sum(dim=-1, keepdim=True)     # top-p / min-p leave it unnormalised
        q = torch.zeros_like(probs)
        if plan.draft_probs:
            q.index_copy_(0, plan.drawn_rows, torch.cat(plan.draft_probs).to(q.dtype))
        point = plan.kinds == POINT
        q.scatter_(1, safe, torch.where(point[:, None], 1.0, q.gather(1, safe)))
        p_d = probs.gather(1, safe)[:, 0]
        q_d = q.gather(1, safe)[:, 0]
        u = sampler.noise(p_d[:, None], batch, "uniform", skip_seeded=plan.plain_rows)[:, 0]
        # u < p/q, written without the division (q(d) > 0 for every drawn proposal).
        sampled_accept = (u * q_d < p_d) & is_proposal
        residual = (probs - q).clamp(min=0.0)
        # p == q leaves nothing: then rejection was impossible, and p is as good a choice.
        empty = residual.sum(dim=-1, keepdim=True) <= 0.0
        recovered = sampler.draw(torch.where(empty | (plan.kinds == PLAIN)[:, None], raw, residual), batch)
        greedy = batch.params[:, TEMPERATURE] == 0.0
        return (torch.where(greedy, target, recovered), torch.where(greedy, greedy_accept, sampled_accept))


def accepted_tokens(spec: list[int], row_tokens: list[int], row_accepted: list[float], first: int) -> list[int]:
    """A request's output from its rows (from `first`): proposals while accepted, then
    the token of the first row not accepted."""
    a = 0
    while a < len(spec) and row_accepted[first + a]:
        a += 1
    return spec[:a] + [row_tokens[first + a]]


def accepted_path(tree: TokenTree, row_proposals: list[float], row_tokens: list[int], row_accepted: list[float],
                  first: int) -> tuple[list[int], list[int]]:
    """A tree verification's output from its rows (from `first`: the root's, then node j's
    at first + 1 + j, holding its token): the standing path's tokens and the last node's
    draw; and the path's nodes."""
    path = tree.walk(row_accepted, first)
    last = first + (1 + path[-1] if path else 0)
    return [int(row_proposals[first + 1 + j]) for j in path] + [row_tokens[last]], path
