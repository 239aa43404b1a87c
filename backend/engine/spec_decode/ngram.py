"""Prompt lookup (n-gram) proposals: no model, only the request's own tokens.

If the last n tokens occurred earlier in the prompt or the output, the tokens that
followed that occurrence are a good guess for what follows now: text that quotes,
edits or summarises a given document repeats it. The longest n in
[prompt_lookup_min, prompt_lookup_max] with a match wins, and of its matches the most
recent (the nearest context). numpy over a sliding window: O(len * n) per request.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` of n_min..n_max tokens; [] when none occurred."""
    L = int(tokens.shape[0])
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # Windows start at 0..L-1-n: each has at least one token after it, and the
        # suffix itself (start L-n) is not among them.
        windows = sliding_window_view(tokens[:L - 1], n)
        hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max

    def propose(self, running: list, eligible: list[tuple[object, int]]) -> None:
        for request, k in eligible:
            tokens = np.asarray(request.all_token_ids, dtype=np.int64)
            request.spec_token_ids = lookup(tokens, self.n_min, self.n_max, k)
            request.draft_probs = None
