"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens.

If the last n tokens occurred earlier in the prompt or the output, the tokens that
followed that occurrence are a good guess for what follows now: text that quotes,
edits or summarises a given document repeats it. The longest n in
[prompt_lookup_min, prompt_lookup_max] with a match wins, and of its matches the most
recent (the nearest context). One vectorised compare over the sequence per step, then
work only at the occurrences of the last token.

Each request's tokens are kept in a numpy array that grows with its output (its prompt
copied once, then each step's new tokens): a step converts no Python list, so its host
work is the new tokens plus that compare (about a nanosecond per token of context).
"""

from __future__ import annotations

import weakref
from typing import Optional

import numpy as np

from backend.engine.spec_decode.speculator import Proposals


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` of n_min..n_max tokens; [] when none occurred."""
    L = int(tokens.shape[0])
    if L < n_min + 1:
        return []
    # Every earlier occurrence ends where the last token occurs (one vectorised compare
    # over the sequence); longer suffixes are checked only at those ends.
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    best_n, best_end = 0, -1
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        candidates = ends[ends >= n - 1]
        if not candidates.size:
            continue
        match = np.ones(candidates.shape[0], dtype=bool)
        for back in range(1, n):
            match &= tokens[candidates - back] == tokens[L - 1 - back]
        hits = candidates[match]
        if hits.size:
            best_n, best_end = n, int(hits[-1])
            break
    if not best_n:
        return []
    return tokens[best_end + 1:best_end + 1 + k].tolist()


class _TokenArray:
    """A request's prompt + output tokens as a growing int32 array, appended to as the
    output grows; rebuilt if the output shrank or a list was replaced."""
    __slots__ = ("ref", "prompt", "output", "buf", "n")

    def __init__(self, request) -> None:
        self.ref = weakref.ref(request)
        self.prompt, self.output = request.prompt_token_ids, request.output_token_ids
        self.buf = np.empty(max(64, 2 * request.num_tokens), dtype=np.int32)
        self.n = 0

    def sync(self, request) -> Optional[np.ndarray]:
        """The tokens so far, or None when this array no longer describes the request."""
        P = len(self.prompt)
        out = self.output
        if (self.ref() is not request or request.prompt_token_ids is not self.prompt
                or request.output_token_ids is not out or len(out) < self.n - P
                or (self.n > P and self.buf[self.n - 1] != out[self.n - P - 1])):
            return None
        if self.n < P:
            self.buf[:P] = self.prompt
            self.n = P
        L = P + len(out)
        if L > self.buf.shape[0]:
            grown = np.empty(2 * L, dtype=np.int32)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        if L > self.n:
            self.buf[self.n:L] = out[self.n - P:]
            self.n = L
        return self.buf[:L]


class NgramProposer:
    in_runner = False       # a lookup on the host, after the scheduler applied the step

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._tokens: dict[str, _TokenArray] = {}
        # Arrays are pruned when their number passes this (amortized: the mark doubles).
        self._prune_at = 64

    def tokens(self, request) -> np.ndarray:
        """The request's tokens as an array, from its kept array plus its new tokens."""
        kept = self._tokens.get(request.request_id)
        tokens = kept.sync(request) if kept is not None else None
        if tokens is None:
            kept = self._tokens[request.request_id] = _TokenArray(request)
            tokens = kept.sync(request)
        return tokens

    def propose(self, running: list, eligible: list[tuple[object, int]]) -> Proposals:
        proposals = Proposals({request.request_id: (lookup(self.tokens(request), self.n_min, self.n_max, k), None)
                               for request, k in eligible})
        # Arrays of requests that finished go (a preempted one's stays while it still describes
        # the request: sync checks). Not by `running`: with async scheduling a speculating
        # request sits out every other step. Pruned only past a doubling mark, so a step
        # does not walk every array.
        if len(self._tokens) > self._prune_at:
            self._tokens = {rid: t for rid, t in self._tokens.items()
                            if (r := t.ref()) is not None and not r.is_finished}
            self._prune_at = max(64, 2 * len(self._tokens))
        return proposals
