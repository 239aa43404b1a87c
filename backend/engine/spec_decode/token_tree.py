"""A static tree of proposals (vLLM's `speculative_token_tree`): which tokens a drafter
proposes for one verification, and how the target checks them all in one forward.

The tree is a list of paths from the root (the request's newest token). A path's last
entry is the node's rank among its parent's children: (0,) is the drafter's most likely
next token, (1,) its second, (0, 0) the most likely token after (0,), (0, 1) the second.
A chain of k proposals is (0,), (0, 0), ... Nodes are kept breadth-first (by depth,
then path), so every parent comes before its children and the nodes up to any count form
a tree too: a request with less room (max_tokens, KV slots, the step's token budget)
takes a prefix of the nodes.

For one verification the nodes follow the root in the request's sequence (node j at
index root + 1 + j, where its K/V is written), each at rotary position root + its
depth, and each attends to the context, the root, and its own ancestors (AttentionMetadata
tree_start / tree_bits: bit j of a token's mask is node j). After the step the
accepted path's K/V is moved to the positions it now holds (`moves`).

Acceptance (the SpecInfer / EAGLE-2 walk with the target alone deciding): each node's
row draws the target's token after that node's path, as decoding one token at a time
would (argmax for greedy requests); from the root, the path follows the child whose
token equals its parent's draw, and ends with the draw of the last node it reached. Each
emitted token is the target's own draw given the tokens before it, so the output is
distributed exactly as the target's, whatever the drafter proposed.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

# A token's mask is one int64 (bit j: node j), so a tree has at most 63 nodes.
MAX_NODES = 63
# A tree's start for a token outside any tree (AttentionMetadata.tree): past every key.
NO_TREE = 2 ** 40


class TreeError(ValueError):
    pass


def parse_tree(text) -> tuple[tuple[int, ...], ...]:
    """vLLM's `speculative_token_tree` (a string such as "[(0,), (1,), (0, 0)]", or the
    list itself) as breadth-first sorted paths; raises TreeError naming what is wrong."""
    try:
        paths = ast.literal_eval(text) if isinstance(text, str) else text
        paths = [tuple(int(c) for c in p) for p in paths]
    except (ValueError, SyntaxError, TypeError):
        raise TreeError(f"{text!r} is not a list of paths such as [(0,), (1,), (0, 0)]") from None
    if not paths:
        raise TreeError("the tree has no nodes")
    if len(paths) > MAX_NODES:
        raise TreeError(f"{len(paths)} nodes; at most {MAX_NODES}")
    if len(set(paths)) != len(paths):
        raise TreeError("a path is listed twice")
    known = set(paths)
    for p in paths:
        if not p or min(p) < 0:
            raise TreeError(f"path {p} is empty or has a negative rank")
        if len(p) > 1 and p[:-1] not in known:
            raise TreeError(f"path {p} has no parent {p[:-1]} in the tree")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]      # breadth-first
    parents: np.ndarray = field(init=False, repr=False, compare=False)    # [N]: parent node, -1 the root
    depths: np.ndarray = field(init=False, repr=False, compare=False)     # [N]: 1 for the root's children
    ranks: np.ndarray = field(init=False, repr=False, compare=False)      # [N]: rank among siblings
    bits: np.ndarray = field(init=False, repr=False, compare=False)       # int64 [N]: ancestors and self
    _prefixes: dict = field(init=False, repr=False, compare=False)      # n -> prefix(n), made once each

    @classmethod
    def parse(cls, text) -> "TokenTree":
        return cls(parse_tree(text))

    @classmethod
    def chain(cls, k: int) -> "TokenTree":
        return cls(tuple((0,) * (i + 1) for i in range(k)))

    def __post_init__(self) -> None:
        index = {p: j for j, p in enumerate(self.paths)}
        parents = np.asarray([index[p[:-1]] if len(p) > 1 else -1 for p in self.paths], dtype=np.int64)
        bits = np.zeros(len(self.paths), dtype=np.int64)
        for j, parent in enumerate(parents):
            bits[j] = (1 << j) | (bits[parent] if parent >= 0 else 0)
        object.__setattr__(self, "_prefixes", {})
        for name, value in (("parents", parents), ("bits", bits),
                            ("depths", np.asarray([len(p) for p in self.paths], dtype=np.int64)),
                            ("ranks", np.asarray([p[-1] for p in self.paths], dtype=np.int64))):
            object.__setattr__(self, name, value)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return int(self.depths[-1])

    @property
    def is_chain(self) -> bool:
        return all(p == (0,) * len(p) for p in self.paths)

    def prefix(self, n: int) -> "TokenTree":
        """The first n nodes (a tree: parents come first)."""
        if n >= self.num_nodes:
            return self
        tree = self._prefixes.get(n)
        if tree is None:
            tree = self._prefixes[n] = TokenTree(self.paths[:n])
        return tree

    def nodes_within(self, depth: int) -> int:
        """How many nodes lie at most `depth` deep: the prefix a request with room for
        `depth` accepted proposals takes."""
        return int(np.searchsorted(self.depths, depth, side="right"))

    @cached_property
    def levels(self) -> list[tuple[int, int]]:
        """Each depth's nodes, [start, end) in node order, from depth 1."""
        bounds = np.searchsorted(self.depths, np.arange(1, self.depth + 2))
        return [(int(bounds[d]), int(bounds[d + 1])) for d in range(self.depth)]

    @cached_property
    def children(self) -> list[list[int]]:
        """children[0]: the root's; children[1 + j]: node j's (in node order)."""
        out: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for j, parent in enumerate(self.parents.tolist()):
            out[parent + 1].append(j)
        return out

    @cached_property
    def max_children(self) -> int:
        """The most candidates any node asks of the drafter (its top-k)."""
        return int(self.ranks.max()) + 1

    def path_of(self, j: int) -> list[int]:
        """Node j's ancestors and itself, root side first."""
        path = []
        while j >= 0:
            path.append(j)
            j = int(self.parents[j])
        return path[::-1]

    def walk(self, accepted: Sequence[float], first: int) -> list[int]:
        """The accepted path (nodes, depth order) from rows `first`... of a verification,
        whose row 1 + j says whether node j's token equals its parent's draw."""
        path, node = [], -1
        while True:
            nxt = next((c for c in self.children[node + 1] if accepted[first + 1 + c]), None)
            if nxt is None:
                return path
            path.append(nxt)
            node = nxt


def moves(path: Sequence[int], root: int) -> tuple[list[int], list[int]]:
    """The sequence indices (source, destination) that move an accepted path's K/V from
    its nodes' places (root + 1 + node) to the positions it holds now (root + depth);
    nodes already in place move nowhere. Increasing destinations never overwrite a
    later source (a node's index is at least its depth - 1)."""
    src, dst = [], []
    for d, node in enumerate(path):
        if node != d:
            src.append(root + 1 + node)
            dst.append(root + 1 + d)
    return src, dst


def step_tree_rows(trees: list[tuple[int, int, TokenTree]], start: np.ndarray, qsl: np.ndarray, pos: np.ndarray,
                   Tp: int) -> np.ndarray:
    """A packed step's [Tp, 2] tree masks (AttentionMetadata.tree) for `trees` (sequence i,
    the index where its tree's nodes start, the tree; StepInputBuilder.build_segments);
    the nodes' rotary positions (their root's plus their depth) written into `pos`, the
    sequence indices until now."""
    rows = np.zeros((Tp, 2), dtype=np.int64)
    rows[:, 0] = NO_TREE
    for i, tree_start, tree in trees:
        first = max(tree_start, int(start[i]))        # (a drafter's level: its earlier nodes are cached)
        n = int(qsl[i + 1]) - int(qsl[i]) - (first - int(start[i]))
        nodes = np.arange(first - tree_start, first - tree_start + n)
        packed = slice(int(qsl[i]) + first - int(start[i]), int(qsl[i + 1]))
        rows[packed, 0] = tree_start
        rows[packed, 1] = tree.bits[nodes]
        pos[packed] = tree_start - 1 + tree.depths[nodes]
    return rows
