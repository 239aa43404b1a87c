"""backend/engine/scheduling/batch_queue.py: micro-batches in flight under pipeline
parallelism, against a fake scheduler, runner and stage (the real pipeline:
tests/unit/parallel/ and the PP serving tests)."""

from types import SimpleNamespace

import pytest

from backend.engine.scheduling.batch_queue import BatchQueue


class Sched:
    def __init__(self, name, empty=False):
        self.name, self.is_empty = name, empty


class Fakes:
    def __init__(self, plan, running=0, waiting=0, max_num_seqs=16):
        """plan: what each schedule() returns, in order (None: an empty step)."""
        self.log, self.plan = [], list(plan)
        fakes = self
        self.scheduler = SimpleNamespace(max_num_seqs=max_num_seqs, running=[0] * running, waiting=[0] * waiting,
                                         exclude_in_flight=False, grammar_bitmask=lambda sched: None)

        def schedule(max_batch_seqs):
            fakes.log.append(("schedule", max_batch_seqs))
            name = fakes.plan.pop(0)
            return Sched(name, empty=name is None)
        self.scheduler.schedule = schedule
        self.workers = SimpleNamespace(nonblocking=False, raise_if_dead=lambda wait_s, cause: fakes.log.append(
            ("raise_if_dead", str(cause))))
        self.stage = SimpleNamespace(defer_logits=False, wait_logits=lambda: fakes.log.append(("wait_logits",)))
        self.runner = SimpleNamespace(workers=self.workers, model=self.stage)
        self.runner.launch = lambda sched: (fakes.log.append(("launch", sched.name)) or
                                            SimpleNamespace(sched=sched, logits=object() if sched.name != "chunk"
                                                            else None))
        self.runner.sample = lambda launched, bitmask: fakes.log.append(("sample", launched.sched.name))
        self.runner.collect = lambda launched: launched.sched.name
        self.runner.update_states = lambda sched: fakes.log.append(("update_states",))

    def queue(self, max_batches):
        return BatchQueue(max_batches, self.scheduler, self.runner,
                          lambda sched, result: [f"out-{result}"])


def test_construction_switches_the_parts_to_pipelined_mode():
    f = Fakes([])
    f.queue(2)
    assert f.scheduler.exclude_in_flight and f.workers.nonblocking and f.stage.defer_logits


def test_batches_fill_the_queue_then_the_oldest_is_collected_first():
    f = Fakes(["b1", "b2", "b3", None, None])
    q = f.queue(2)
    assert q.step() == [] and q.busy                       # b1 launched: room for another
    assert q.step() == ["out-b1"]                          # b2 launched, queue full: b1 collected
    assert q.step() == ["out-b2"]                          # b3 launched, full again: b2 collected
    assert q.step() == ["out-b3"]                          # nothing to schedule: the oldest
    assert not q.busy
    assert [e for e in f.log if e[0] in ("launch", "sample")] == [
        ("launch", "b1"), ("launch", "b2"), ("sample", "b1"), ("launch", "b3"), ("sample", "b2"), ("sample", "b3")]
    assert q.stats() == {"max_concurrent_batches": 2, "num_batches": 3, "num_overlapped_batches": 2}
    assert q.step() == [] and f.log[-1] == ("update_states",)   # idle: the empty step's ids still go out


def test_a_batch_without_logits_is_not_waited_for():
    """A prompt chunk alone samples nothing: no logits receive was posted for it."""
    f = Fakes(["chunk", None])
    q = f.queue(1)
    assert q.step() == ["out-chunk"]
    assert ("wait_logits",) not in f.log


def test_each_batch_takes_its_share_of_the_requests_that_could_run():
    f = Fakes(["b1"], running=5, waiting=20, max_num_seqs=16)
    f.queue(3).step()
    assert f.log[0] == ("schedule", 6)                     # ceil(min(16, 25) / 3)
    f = Fakes(["b1"])
    f.queue(4).step()
    assert f.log[0] == ("schedule", 1)                     # never 0


def test_a_failure_names_a_dead_rank_first():
    f = Fakes(["b1"])
    q = f.queue(1)
    f.runner.launch = lambda sched: (_ for _ in ()).throw(RuntimeError("gloo: connection closed"))
    with pytest.raises(RuntimeError):
        q.step()
    assert f.log[-1] == ("raise_if_dead", "gloo: connection closed")
