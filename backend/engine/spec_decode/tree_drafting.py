"""Drafting a tree of proposals (token_tree.py), level by level, on the device.

A node of rank r is its parent's r-th most likely next token under the drafter (top-k,
whatever the request's sampling: the target's walk accepts a node only where the
target's own draw equals it, so the output is the target's distribution whichever
candidates are proposed). Every proposing request's nodes are kept in one [R, N] tensor,
row r holding its first k_r nodes; each level's candidates are written there with one
gather and one scatter, all of the levels' indices in one upload.

- Medusa: head d's top-k at the last accepted position gives the nodes at depth d + 1.
- EAGLE: the catch-up's distribution gives depth 1; then one forward per level over
  that level's nodes, each at its own slot with the tree's mask (the head's tree starts
  at the newest token's index: its node j writes K/V at newest + j, rotary position
  newest - 1 + depth), gives the next level's candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend.engine.spec_decode.draft_tokens import DraftTokens
from backend.engine.spec_decode.token_tree import TokenTree


def top_candidates(logits: torch.Tensor, k: int, vocab_size: int, to_target=None) -> torch.Tensor:
    """[rows, k] the k most likely target token ids per row (a reduced draft vocabulary's
    ids mapped through `to_target`)."""
    if to_target is not None:
        return to_target[logits.topk(k, dim=-1).indices]
    return logits[:, :vocab_size].topk(k, dim=-1).indices


@dataclass
class Level:
    """One EAGLE forward: the requests (positions in the proposing list) with nodes one
    level deeper, and index ranges into the layout's upload."""
    depth: int                  # the forwarded nodes' depth
    active: list[int]
    width: int                  # nodes at that depth
    first: int                  # the first of them
    inputs: slice               # their ids in the node table (flat)
    kept: slice                 # the rows of the previous forward their hidden inputs come from
    fill: tuple[slice, slice]   # (node table places, candidate places) of the next level


def level_plan(tree: TokenTree, ks: list[int]) -> tuple[np.ndarray, tuple[slice, slice], list[Level]]:
    """Every index the drafting of `ks[r]` nodes for each proposing request takes: (the
    concatenated indices, depth 1's fill from the catch-up's candidates, the levels)."""
    N, kmax, R = tree.num_nodes, tree.max_children, len(ks)
    parts: list[np.ndarray] = []
    used = [0]

    def add(values) -> slice:
        a = np.asarray(values, dtype=np.int64).reshape(-1)
        parts.append(a)
        used[0] += a.shape[0]
        return slice(used[0] - a.shape[0], used[0])

    s1, e1 = tree.levels[0]
    rows = np.arange(R)[:, None]
    first_fill = (add(rows * N + np.arange(s1, e1)[None, :]), add(rows * kmax + tree.ranks[s1:e1][None, :]))
    levels: list[Level] = []
    prev_active: list[int] = list(range(R))
    prev_first, prev_width = 0, 1          # (the catch-up: one row per request, the root)
    for d in range(1, tree.depth):
        s, e = tree.levels[d - 1]
        cs, ce = tree.levels[d]
        active = [r for r in prev_active if ks[r] > cs]
        if not active:
            break
        width = e - s
        act = np.asarray(active)[:, None]
        nodes = np.arange(s, e)[None, :]
        where = {r: n for n, r in enumerate(prev_active)}
        prev_pos = np.asarray([where[r] for r in active])[:, None]
        parent_off = (tree.parents[s:e] - prev_first)[None, :] if d > 1 else np.zeros((1, width), np.int64)
        kept = add(prev_pos * prev_width + parent_off)
        inputs = add(act * N + nodes)
        children = np.arange(cs, ce)[None, :]
        src = (np.arange(len(active))[:, None] * width + (tree.parents[cs:ce] - s)[None, :]) * kmax \
            + tree.ranks[cs:ce][None, :]
        fill = (add(act * N + children), add(src))
        levels.append(Level(d, active, width, s, inputs, kept, fill))
        prev_active, prev_first, prev_width = active, s, width
    return np.concatenate(parts), first_fill, levels


def medusa_plan(tree: TokenTree, num_rows: int) -> np.ndarray:
    """Where each row's nodes, in order, take their tokens from the heads' stacked top-k
    ([depth, rows, k]): node j of row r from head depth_j - 1's candidate rank_j."""
    rows = np.arange(num_rows)[:, None]
    return (((tree.depths - 1)[None, :] * num_rows + rows) * tree.max_children + tree.ranks[None, :]).reshape(-1)


def hand_over(request_ids: list[str], table: torch.Tensor, ks: list[int]) -> dict:
    """Each request's first k nodes, left on the device: Proposals.tokens entries (no
    draft distributions: a tree's acceptance needs none)."""
    flat, read, N = table.reshape(-1), [None], table.shape[1]
    return {rid: (DraftTokens(flat, r * N, k, read), None) for r, (rid, k) in enumerate(zip(request_ids, ks))}
