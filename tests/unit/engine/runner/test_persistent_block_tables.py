"""The persistent block table's host side (backend/engine/runner/persistent_block_tables.py)
alone: a request keeps its row; a step sends only the entries that changed (none for an
unchanged table, the tail after a trim and regrowth); rows of requests that gave their
blocks back are reused first, then the least recently used outside the build; a table
wider than a row is refused by name. The device side: test_step_inputs.py."""

import pytest

from backend.engine.block_table import BlockTable
from backend.engine.runner.persistent_block_tables import PersistentBlockTables


def table(*ids: int) -> BlockTable:
    t = BlockTable()
    t.append_blocks(list(ids))
    return t


def row(tables: PersistentBlockTables, rid: str, t) -> tuple[int, list[int], list[int]]:
    index, values = [], []
    slot = tables.row(rid, t, index, values)
    return slot, index, values


def test_a_row_sends_only_what_changed():
    tables = PersistentBlockTables(max_num_seqs=2, max_blocks_per_seq=4)
    a = table(5, 6)
    tables.begin()
    slot, index, values = row(tables, "a", a)
    assert (index, values) == ([slot * 4, slot * 4 + 1], [5, 6])
    tables.begin()
    assert row(tables, "a", a) == (slot, [], [])                    # unchanged: nothing to send
    a.append_blocks([7])
    tables.begin()
    assert row(tables, "a", a) == (slot, [slot * 4 + 2], [7])      # the new entry alone
    a.truncate(1)
    a.append_blocks([8, 9])                                         # trimmed, then others in place
    tables.begin()
    assert row(tables, "a", a) == (slot, [slot * 4 + 1, slot * 4 + 2], [8, 9])
    assert tables.host[slot, :3].tolist() == [5, 8, 9]


def test_a_plain_list_is_sent_whole_every_time():
    tables = PersistentBlockTables(2, 4)
    tables.begin()
    slot, _, _ = row(tables, "a", [1, 2])
    tables.begin()
    assert row(tables, "a", [1, 2]) == (slot, [slot * 4, slot * 4 + 1], [1, 2])


def test_rows_are_reused_emptied_first_then_least_recently_used():
    tables = PersistentBlockTables(max_num_seqs=2, max_blocks_per_seq=4)
    a, b = table(1), table(2)
    tables.begin()
    slot_a, _, _ = row(tables, "a", a)
    tables.begin()
    slot_b, _, _ = row(tables, "b", b)
    a.truncate(0)                                   # a gave its blocks back (finished)
    tables.begin()
    assert row(tables, "c", table(3))[0] == slot_a
    tables.begin()
    assert row(tables, "d", table(4))[0] == slot_b  # b: the least recently used
    tables.begin()
    row(tables, "d", table(4))
    with pytest.raises(ValueError, match="more sequences in a step than max_num_seqs"):
        for rid in ("e", "f"):                      # (one build with three rows for two)
            row(tables, rid, table(5))


def test_a_table_wider_than_a_row_is_refused():
    tables = PersistentBlockTables(2, 2)
    tables.begin()
    with pytest.raises(ValueError, match="exceeds max_blocks_per_seq"):
        row(tables, "a", table(1, 2, 3))
