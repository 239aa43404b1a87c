import numpy as np

from backend.engine.spec_decode.ngram import lookup


def t(*xs):
    return np.asarray(xs, dtype=np.int64)


def test_longest_suffix_wins_and_the_latest_occurrence():
    # Suffix [3, 4] occurred at 1 (followed by 9) and at 5 (followed by 7 8); [4] alone also at 10.
    tokens = t(0, 3, 4, 9, 0, 3, 4, 7, 8, 1, 4, 2, 3, 4)
    assert lookup(tokens, 1, 3, 2) == [7, 8]
    assert lookup(tokens, 1, 1, 3) == [2, 3, 4]            # n = 1: the latest 4 before the suffix


def test_no_match_and_bounds():
    assert lookup(t(1, 2, 3), 1, 3, 4) == []
    assert lookup(t(5), 1, 3, 4) == []
    assert lookup(t(1, 2, 1), 2, 3, 4) == []                # only n = 1 matches, below the minimum
    # The continuation may run into the suffix itself (a period of 2), never past the end.
    assert lookup(t(1, 2, 1, 2), 1, 2, 5) == [1, 2]
