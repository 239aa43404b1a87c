"""backend/engine/block_table.py: a copy kept by the owner's diffs alone equals the owner's
table after any appends and trims, and a diff holds only what changed."""

import random

import pytest

from backend.engine.block_table import BlockTable


def test_a_copy_kept_by_diffs_equals_the_table():
    rng = random.Random(0)
    owner, copy = BlockTable(), BlockTable()
    next_id = 0
    for _ in range(500):
        for _ in range(rng.randrange(0, 3)):        # changes between two steps
            if owner and rng.random() < 0.4:
                owner.truncate(rng.randrange(0, len(owner) + 1))
            else:
                k = rng.randrange(1, 4)
                owner.append_blocks(list(range(next_id, next_id + k)))
                next_id += k
        before = list(copy)
        start, ids = owner.take_diff()
        copy.apply_diff(start, ids)
        assert copy == owner and len(copy.serials) == len(copy)
        # Only the changed tail: entries before `start` are the copy's own, untouched.
        assert before[:start] == owner[:start] and start + len(ids or []) == len(owner)
        assert ids is not None or before == owner
        assert owner.take_diff() == (len(owner), None)      # nothing changed since


def test_unchanged_entries_keep_their_serials_and_replaced_ones_get_new_ones():
    t = BlockTable()
    t.append_blocks([4, 5, 6])
    kept = t.serials[:2]
    t.truncate(2)
    t.append_blocks([6])                # the same id in the same place: still a new entry
    assert t.serials[:2] == kept and t.serials[2] not in kept
    assert t.take_diff() == (0, [4, 5, 6])          # (never taken: all of it)
    t.truncate(1)
    assert t.take_diff() == (1, [])                 # a trim alone is a change too
    assert t.take_diff() == (1, None)


def test_a_diff_past_the_copy_is_refused():
    with pytest.raises(ValueError, match="from entry 2"):
        BlockTable().apply_diff(2, [1])
