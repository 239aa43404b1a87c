"""Drafting a tree level by level (backend/engine/spec_decode/tree_drafting.py), without a
model: a fake drafter whose candidates after a token are a function of that token, driven
through level_plan's indices as EagleProposer drives its head, must fill each request's
node table with every node's token as the tree's paths define it; medusa_plan must take
node j's token from head depth_j - 1 at rank_j."""

import numpy as np
import pytest
import torch

from backend.engine.spec_decode.token_tree import TokenTree
from backend.engine.spec_decode.tree_drafting import hand_over, level_plan, medusa_plan, top_candidates

V = 1009


def child(token: int, rank: int) -> int:
    """The fake drafter's rank-th candidate after `token`."""
    return (token * 7 + 3 * rank + 1) % V


def fake_logits(tokens: torch.Tensor, kmax: int) -> torch.Tensor:
    """Logits whose top-kmax, in order, are child(token, 0..kmax-1) for each row's token."""
    logits = torch.zeros(len(tokens), V)
    for i, t in enumerate(tokens.tolist()):
        for rank in range(kmax):
            logits[i, child(t, rank)] = float(kmax - rank)
    return logits


def expected_tokens(tree: TokenTree, root: int, k: int) -> list[int]:
    tokens = []
    for j in range(k):
        token = root
        for rank in tree.paths[j]:
            token = child(token, rank)
        tokens.append(token)
    return tokens


@pytest.mark.parametrize("paths,ks", [
    ("[(0,), (1,), (0, 0), (0, 0, 0)]", [4, 4]),
    ("[(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1)]", [8, 3, 6, 1]),
    ("[(0,), (0, 0), (0, 0, 0)]", [3, 2]),              # a chain
])
def test_the_levels_fill_every_requests_nodes_in_path_order(paths, ks):
    tree = TokenTree.parse(paths)
    roots = [11 * (r + 1) for r in range(len(ks))]
    kmax, N = tree.max_children, tree.num_nodes
    index, first_fill, levels = level_plan(tree, ks)
    index = torch.from_numpy(index)
    table = torch.zeros(len(ks), N, dtype=torch.int64)
    flat = table.view(-1)
    # the catch-up: one row per proposing request, its input the root (the newest token)
    prev_inputs = torch.tensor(roots)
    top = top_candidates(fake_logits(prev_inputs, kmax), kmax, V).reshape(-1)
    flat.index_copy_(0, index[first_fill[0]], top.index_select(0, index[first_fill[1]]))
    for level in levels:
        inputs = flat.index_select(0, index[level.inputs])
        # Each forwarded node reads the hidden output of its parent's row in the previous forward.
        parents = prev_inputs.index_select(0, index[level.kept])
        width = level.width
        for n, node_token in enumerate(inputs.tolist()):
            r, j = level.active[n // width], level.first + n % width
            parent = int(tree.parents[j])
            assert parents[n] == (roots[r] if parent < 0 else table[r, parent])
            assert node_token == table[r, j]
        top = top_candidates(fake_logits(inputs, kmax), kmax, V).reshape(-1)
        flat.index_copy_(0, index[level.fill[0]], top.index_select(0, index[level.fill[1]]))
        prev_inputs = inputs
    for r, k in enumerate(ks):
        assert table[r, :k].tolist() == expected_tokens(tree, roots[r], k), f"request {r}"
    # Levels run only while some request has nodes that deep.
    assert len(levels) == max(int(tree.depths[k - 1]) for k in ks) - 1
    handed = hand_over([f"r{r}" for r in range(len(ks))], table, ks)
    assert [handed[f"r{r}"][0].tolist() for r in range(len(ks))] == [table[r, :k].tolist() for r, k in enumerate(ks)]


def test_a_reduced_draft_vocabulary_maps_candidates_to_target_ids():
    to_target = torch.tensor([5, 9, 2, 7])
    logits = torch.tensor([[0.1, 3.0, 2.0, 0.0]])
    assert top_candidates(logits, 2, 10, to_target).tolist() == [[9, 2]]
    assert top_candidates(torch.tensor([[0.0, 1.0, 5.0]]), 1, 2).tolist() == [[1]]    # past the vocabulary: never


def test_medusa_nodes_take_their_heads_candidates():
    tree = TokenTree.parse("[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)]")
    rows, kmax = 3, tree.max_children
    candidates = torch.arange(tree.depth * rows * kmax).reshape(tree.depth, rows, kmax)
    taken = candidates.reshape(-1)[torch.from_numpy(medusa_plan(tree, rows))].reshape(rows, -1)
    for r in range(rows):
        assert taken[r].tolist() == [int(candidates[tree.depths[j] - 1, r, tree.ranks[j]]) for j in range(tree.num_nodes)]
    assert np.array_equal(tree.depths, [1, 1, 1, 2, 2, 3])
