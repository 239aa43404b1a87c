"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens.

If the last n tokens occurred earlier in the prompt or the output, the tokens that
followed that occurrence are a good guess for what follows now: text that quotes,
edits or summarises a given document repeats it. The longest n in
[prompt_lookup_min, prompt_lookup_max] with a match wins, and of its matches the most
recent (the nearest context). One vectorised compare over the sequence per step, then
work only at the occurrences of the last token.
"""

from __future__ import annotations

import numpy as np


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


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, running: list, eligible: list[tuple[object, int]]) -> None:
        for request, k in eligible:
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            request.spec_token_ids = lookup(tokens, self.n_min, self.n_max, k)
            request.draft_probs = None
