"""The prompt lookup's answer in time that does not grow with the context: the exact
scan for short sequences, an incremental n-gram index of the request's tokens beyond.

The scan (`lookup`) compares the newest token against every earlier one, about a
nanosecond a token: below SCAN_MAX_TOKENS it is cheaper than any index's constant (a few
microseconds of Python a request), so short requests keep it and build nothing.

From SCAN_MAX_TOKENS on, NgramIndex maps every n-gram (n_min <= n <= n_max) that ended
before the newest token to its latest end. A step indexes only the ends its new tokens
add, then looks up the newest suffixes: work per step is the new tokens times the n's,
not the context. Keys are 64-bit polynomial hashes of the n tokens, salted by n. Most
ends sit in one sorted array built in a vectorised pass (one binary search per lookup
for every n; 16 bytes an end and n); the ends added since sit in a dict. The array is
rebuilt once the dict holds more than a quarter of what it does, so a token costs a
constant amortized share of a rebuild and the dict stays small. A hit is checked
against the tokens themselves; where two n-grams share a key (2^-64 by chance; an
adversary can construct it) the scan answers for that n, so the proposals are always
the scan's.
"""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
# The hash's multiplier: odd (so each power is a unit mod 2^64), bits mixed (2^64 / phi).
BASE = 0x9E3779B97F4A7C15
# Added to an n-gram's hash times n, so that the n's share one array.
SALT = 0xD6E8FEB86659FD93
# The dict is folded into the array past max(this, a quarter of the array's ends).
MIN_PENDING = 256
# Shorter sequences are scanned (benchmarks.bench_ngram: the index's constant is about the
# scan's cost at 8-16k tokens with n 2-5).
SCAN_MAX_TOKENS = 8192


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


class NgramIndex:
    __slots__ = ("n_min", "n_max", "indexed", "rebuilt_ends", "_pow", "_salt", "_keys", "_ends", "_recent", "_base")

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.indexed = 0            # ends < this are indexed
        self.rebuilt_ends = 0       # ends indexed by rebuilds, all told (their amortized cost)
        self._pow = [pow(BASE, i, 1 << 64) for i in range(n_max)]
        self._salt = [(n * SALT) & _MASK for n in range(n_max + 1)]
        self._keys = np.empty(0, dtype=np.uint64)
        self._ends = np.empty(0, dtype=np.int64)
        self._recent: dict[int, int] = {}
        self._base = 0              # ends < this are in the array, the rest in `_recent`

    def update(self, tokens: np.ndarray) -> None:
        """Indexes the n-grams of `tokens` (the request's tokens so far, an extension of
        those seen before) that end before its last token; nothing while the sequence is
        short enough to scan."""
        upto = int(tokens.shape[0]) - 1
        if upto <= self.indexed or upto < SCAN_MAX_TOKENS:
            return
        if upto - self._base > max(MIN_PENDING, self._base // 4):
            self._rebuild(tokens, upto)
            return
        first = max(self.indexed - self.n_max + 1, 0)
        window = tokens[first:upto].tolist()
        for e in range(self.indexed, upto):
            for key in self._keys_ending(window, e - first):
                self._recent[key] = e
        self.indexed = upto

    def _keys_ending(self, window: list[int], end: int) -> list[int]:
        """The keys of the n-grams (n_min..n_max, shortest first) that end at
        window[end]; as many as the window holds tokens up to there (the window starts at
        the sequence's start or at least n_max - 1 tokens before `end`)."""
        keys, h = [], 0
        for n in range(1, min(self.n_max, end + 1) + 1):
            h = (h + window[end - n + 1] * self._pow[n - 1]) & _MASK
            if n >= self.n_min:
                keys.append((h + self._salt[n]) & _MASK)
        return keys

    def _rebuild(self, tokens: np.ndarray, upto: int) -> None:
        """The array over every end before `upto`, in one vectorised pass; the dict emptied."""
        t = tokens[:upto].astype(np.uint64)
        h = np.zeros(upto, dtype=np.uint64)            # h[e]: the hash of the n tokens ending at e
        keys, ends = [], []
        for n in range(1, min(self.n_max, upto) + 1):  # (uint64 arithmetic wraps: mod 2^64)
            h[n - 1:] += t[:upto - n + 1] * np.uint64(self._pow[n - 1])
            if n >= self.n_min:
                keys.append(h[n - 1:] + np.uint64(self._salt[n]))
                ends.append(np.arange(n - 1, upto, dtype=np.int64))
        keys = np.concatenate(keys) if keys else np.empty(0, dtype=np.uint64)
        ends = np.concatenate(ends) if ends else np.empty(0, dtype=np.int64)
        order = np.lexsort((ends, keys))               # by key, then end: a key's last is its latest end
        sorted_keys = keys[order]
        last = np.ones(sorted_keys.shape[0], dtype=bool)
        last[:-1] = sorted_keys[1:] != sorted_keys[:-1]
        self._keys, self._ends = sorted_keys[last], ends[order[last]]
        self._recent = {}
        self.rebuilt_ends += upto
        self._base = self.indexed = upto

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """`lookup(tokens, n_min, n_max, k)`: up to k tokens that followed the latest
        earlier occurrence of the longest suffix of n_min..n_max tokens. `update(tokens)`
        must have been called with these tokens."""
        L = int(tokens.shape[0])
        if L - 1 < SCAN_MAX_TOKENS:
            return lookup(tokens, self.n_min, self.n_max, k)
        top = min(self.n_max, L - 1)
        if top < self.n_min:
            return []
        tail = tokens[L - top:].tolist()
        queries = self._keys_ending(tail, top - 1)[::-1]       # longest n first
        found = [self._recent.get(q) for q in queries]      # (newer than any end in the array)
        size = self._keys.shape[0]
        if None in found and size:
            at = np.searchsorted(self._keys, np.asarray(queries, dtype=np.uint64)).tolist()
            for i, end in enumerate(found):
                if end is None and at[i] < size and int(self._keys[at[i]]) == queries[i]:
                    found[i] = int(self._ends[at[i]])
        for n, end in zip(range(top, self.n_min - 1, -1), found):
            if end is None:
                continue
            if end >= n - 1 and tokens[end - n + 1:end + 1].tolist() == tail[top - n:]:
                return tokens[end + 1:end + 1 + k].tolist()
            proposal = lookup(tokens, n, n, k)      # another n-gram with this key
            if proposal:
                return proposal
        return []
