"""backend/engine/early_aborts.py: aborts held for requests not yet added, bounded."""

import time

from backend.engine.early_aborts import EarlyAborts


def test_a_held_abort_is_taken_once():
    held = EarlyAborts()
    held.hold("a", "abort-a")
    assert held.take("b") is None
    assert held.take("a") == "abort-a" and held.take("a") is None


def test_held_aborts_expire_and_are_bounded():
    held = EarlyAborts(hold_s=0.05, max_held=3)
    for i in range(5):
        held.hold(str(i), i)
    assert len(held) == 3 and held.take("0") is None and held.take("4") == 4
    time.sleep(0.06)
    assert held.take("3") is None       # stale: its request finished long ago
    held.hold("x", "x")
    assert len(held) == 1               # the stale ones went as a new one came
