"""The incremental n-gram index answers as the exact scan does, step by step, and its
work per step does not grow with the context."""

import numpy as np
import pytest

from backend.engine.spec_decode import ngram_index
from backend.engine.spec_decode.ngram_index import NgramIndex, lookup


def _grow(rng, index, tokens, steps, k, vocab):
    """Appends 1-5 tokens a step (sometimes a copy of an earlier stretch, so long matches
    occur) and checks the index against the scan after each."""
    for _ in range(steps):
        if rng.random() < 0.3 and len(tokens) > 8:
            a = int(rng.integers(0, len(tokens) - 4))
            tokens.extend(tokens[a:a + int(rng.integers(1, 5))])
        else:
            tokens.extend(rng.integers(0, vocab, int(rng.integers(1, 6))).tolist())
        arr = np.asarray(tokens, dtype=np.int32)
        index.update(arr)
        assert index.lookup(arr, k) == lookup(arr, index.n_min, index.n_max, k), (len(tokens), index.n_min, index.n_max)


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 3), (2, 4), (5, 5), (3, 8)])
def test_the_index_answers_as_the_scan(monkeypatch, n_min, n_max):
    """Through the scan below its threshold, then the dict, the rebuilt array and both
    together (small thresholds, so a few hundred steps cross to the index and rebuild
    many times), on prompts of every size from empty to past the thresholds."""
    monkeypatch.setattr(ngram_index, "MIN_PENDING", 16)
    monkeypatch.setattr(ngram_index, "SCAN_MAX_TOKENS", 50)
    rng = np.random.default_rng(n_min * 10 + n_max)
    for prompt_len in (0, 1, 5, 40, 300):
        for vocab in (3, 50):
            index = NgramIndex(n_min, n_max)
            tokens = rng.integers(0, vocab, prompt_len).tolist()
            if tokens:
                index.update(np.asarray(tokens, dtype=np.int32))
            _grow(rng, index, tokens, 150, 4, vocab)
        assert index.rebuilt_ends > 0


def test_hash_collisions_fall_back_to_the_scan(monkeypatch):
    """With a multiplier and salt of 0 every n-gram's key is its last token, so nearly every
    hit is another n-gram (of this n or another): each must be caught and the scan's
    answer given."""
    monkeypatch.setattr(ngram_index, "BASE", 0)
    monkeypatch.setattr(ngram_index, "SALT", 0)
    monkeypatch.setattr(ngram_index, "MIN_PENDING", 16)
    monkeypatch.setattr(ngram_index, "SCAN_MAX_TOKENS", 0)
    rng = np.random.default_rng(7)
    for n_min, n_max in ((2, 4), (3, 3)):
        index = NgramIndex(n_min, n_max)
        _grow(rng, index, rng.integers(0, 4, 60).tolist(), 200, 3, 4)


def test_a_key_shared_across_n_keeps_its_latest_end(monkeypatch):
    """A salt that gives the 3-gram (7, 1, 2) the key of the 2-gram (1, 2): the array must
    keep that key's latest end, whichever n it came from, so the index still proposes
    the 2-gram's latest occurrence (the scan's 200, not the 3-gram's older 100)."""
    monkeypatch.setattr(ngram_index, "SALT", (-7 * pow(ngram_index.BASE, 2, 1 << 64)) & ((1 << 64) - 1))
    monkeypatch.setattr(ngram_index, "SCAN_MAX_TOKENS", 10)
    monkeypatch.setattr(ngram_index, "MIN_PENDING", 4)
    tokens = np.asarray(list(range(20, 32)) + [7, 1, 2, 100, 8, 1, 2, 200, 40, 41, 42, 9, 1, 2], dtype=np.int32)
    index = NgramIndex(2, 3)
    index.update(tokens)
    assert index._keys.size and not index._recent           # (the array answers)
    assert lookup(tokens, 2, 3, 1) == [200]
    assert index.lookup(tokens, 1) == [200]


def test_a_steps_work_does_not_grow_with_the_context(monkeypatch):
    """A 2,000-token prompt grown one token a step to 20,000 tokens, past the scan's
    threshold: the scan never runs, the rebuilds index at most a few times the tokens in
    all (a constant amortized share per token), and the dict of recent ends stays bounded
    by a quarter of the array."""
    def no_scan(*a, **kw):
        raise AssertionError("the exact scan ran without a hash collision")
    monkeypatch.setattr(ngram_index, "SCAN_MAX_TOKENS", 1000)
    monkeypatch.setattr(ngram_index, "lookup", no_scan)
    rng = np.random.default_rng(1)
    tokens = np.empty(20_000, dtype=np.int32)
    tokens[:] = rng.integers(0, 1000, 20_000)
    tokens[10_000:10_400] = tokens[500:900]     # (a quoted stretch: long matches too)
    index = NgramIndex(2, 5)
    biggest_dict = 0
    for L in range(2_000, 20_001):
        index.update(tokens[:L])
        proposed = index.lookup(tokens[:L], 4)
        if L == 10_200:             # the suffix ends at 10,199, a copy of 699
            assert proposed == tokens[700:704].tolist()
        biggest_dict = max(biggest_dict, len(index._recent) // 4)     # (4 n's)
        assert biggest_dict <= max(ngram_index.MIN_PENDING, index._base // 4) + 1
    assert index.rebuilt_ends <= 6 * 20_000


def test_short_sequences_are_scanned_and_build_nothing():
    """Below SCAN_MAX_TOKENS the scan answers (cheaper there) and no index is kept."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 5, ngram_index.SCAN_MAX_TOKENS - 1).astype(np.int32)
    index = NgramIndex(2, 5)
    index.update(tokens)
    assert index.indexed == 0 and index._keys.size == 0 and not index._recent
    assert index.lookup(tokens, 4) == lookup(tokens, 2, 5, 4) != []
    longer = np.concatenate([tokens, tokens[:10]])
    index.update(longer)
    assert index.indexed == longer.shape[0] - 1
    assert index.lookup(longer, 4) == lookup(longer, 2, 5, 4) != []
