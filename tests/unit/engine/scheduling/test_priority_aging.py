"""The optional aging rule of priority scheduling (engine argument `priority_aging_s`,
backend/engine/scheduling/priority.py): against a steady stream of high-priority
requests, a low-priority one starves without aging and is served with it; aged
priorities order the queue and decide preemption."""

import pytest

from backend.config import EngineArgs
from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.scheduling.priority import PriorityQueue, Ranking
from backend.engine.scheduling.scheduler import Scheduler
from tests.unit.engine.scheduling.test_priority import request, step


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stream_of_high_priority_work(aging_s):
    """One sequence slot; a low-priority request arrives at 0, then a high-priority one
    every tick, each served in one step. Returns when the low one finished (None: never,
    in 40 ticks)."""
    clock = Clock()
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=64, policy="priority",
                          ranking=Ranking(aging_s, clock))
    scheduler.add_request(request("low", 4, 5, 0.0, max_tokens=1))
    scheduler.add_request(request("high-0", 4, 0, 0.0, max_tokens=1))
    for tick in range(1, 40):
        clock.now = float(tick)
        scheduler.add_request(request(f"high-{tick}", 4, 0, clock.now, max_tokens=1))
        if "low" in step(scheduler)[2]:
            return tick
    return None


def test_without_aging_low_priority_starves_and_with_it_is_served():
    assert stream_of_high_priority_work(None) is None
    # Five levels behind, one level per 2 s: at 10 s it ties the newest high-priority
    # request and is older, so it runs in that step.
    assert stream_of_high_priority_work(2.0) == 10


def test_aged_priorities_order_the_queue():
    clock = Clock()
    q = PriorityQueue(Ranking(5.0, clock))
    q.append(request("old-low", 1, 1, 0.0))
    q.append(request("new-high", 1, 0, 9.0))
    assert [r.request_id for r in q] == ["new-high", "old-low"]
    clock.now = 12.0            # old-low: 1 - 2 = -1; new-high: 0 - 0 = 0
    q.reorder()
    assert [r.request_id for r in q] == ["old-low", "new-high"]


def test_aging_is_for_the_priority_policy():
    with pytest.raises(ValueError, match="priority_aging_s needs scheduling_policy 'priority'"):
        EngineArgs(model="x", priority_aging_s=1.0)
    assert EngineArgs(model="x", scheduling_policy="priority", priority_aging_s=1.0).priority_aging_s == 1.0
