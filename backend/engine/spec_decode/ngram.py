"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens.

If the last n tokens occurred earlier in the prompt or the output, the tokens that
followed that occurrence are a good guess for what follows now: text that quotes,
edits or summarises a given document repeats it. The longest n in
[prompt_lookup_min, prompt_lookup_max] with a match wins, and of its matches the most
recent (the nearest context).

Each request's tokens are kept in a numpy array that grows with its output (its prompt
copied once, then each step's new tokens), with an n-gram index of them
(ngram_index.py): below 8,192 tokens a step scans the array (about a nanosecond a
token); beyond, the index answers from the step's new tokens and a few lookups,
whatever the context's length. Either way the proposals are the exact scan's.
"""

from __future__ import annotations

import weakref
from typing import Optional

import numpy as np

from backend.engine.spec_decode.ngram_index import NgramIndex
from backend.engine.spec_decode.proposals import Proposals


class _TokenArray:
    """A request's prompt + output tokens as a growing int32 array, appended to as the
    output grows; rebuilt if the output shrank or a list was replaced."""
    __slots__ = ("ref", "prompt", "output", "buf", "n", "index")

    def __init__(self, request, n_min: int, n_max: int) -> None:
        self.ref = weakref.ref(request)
        self.prompt, self.output = request.prompt_token_ids, request.output_token_ids
        self.buf = np.empty(max(64, 2 * request.num_tokens), dtype=np.int32)
        self.n = 0
        self.index = NgramIndex(n_min, n_max)

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

    def lookup(self, request, k: int) -> list[int]:
        """The request's proposals: its kept array brought up to its tokens, the array's
        index extended by the new ones, then looked up."""
        kept = self._tokens.get(request.request_id)
        tokens = kept.sync(request) if kept is not None else None
        if tokens is None:      # (new, or its output was cut or replaced: indexed afresh)
            kept = self._tokens[request.request_id] = _TokenArray(request, self.n_min, self.n_max)
            tokens = kept.sync(request)
        kept.index.update(tokens)
        return kept.index.lookup(tokens, k)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._tokens.pop(request_id, None)

    def propose(self, running: list, eligible: list[tuple[object, int]]) -> Proposals:
        proposals = Proposals({request.request_id: (self.lookup(request, k), None) for request, k in eligible})
        # Arrays of requests that finished go: at once through `forget` when they end in the
        # engine, and here any the engine did not name (a preempted one's stays while it
        # still describes the request: sync checks). Not by `running`: with async
        # scheduling a speculating request sits out every other step. Pruned only past a
        # doubling mark, so a step does not walk every array.
        if len(self._tokens) > self._prune_at:
            self._tokens = {rid: t for rid, t in self._tokens.items()
                            if (r := t.ref()) is not None and not r.is_finished}
            self._prune_at = max(64, 2 * len(self._tokens))
        return proposals
