"""Priority scheduling (engine argument `scheduling_policy: priority`, vLLM's name): each
request's `priority` (lower runs first, as in vLLM; ties by arrival) orders the waiting
queue and the running batch.

The scheduler stays as it is for FCFS; under priority it keeps both queues in this
order, so the running request it preempts when blocks run out (the last) is always the
lowest-ranked one, never a higher-priority request for a lower one, and a waiting
request that outranks the lowest-ranked running one takes its place when the pool or
`max_num_seqs` has no room for it.

Without aging (the default, as in vLLM) a steady stream of higher-priority work keeps
lower priorities waiting. With the engine argument `priority_aging_s` a request's
priority improves by one level per that many seconds since it arrived, so every request
eventually outranks the newer work. Both queues are put in order again before each
schedule then, and preemption compares these aged priorities too.

First-token steps: while a request's first token is in flight (async scheduling), and in
a step that has scheduled a chunk of its prompt, prompt chunks of lower-ranked requests
visited after it sit the step out; their decodes still run (FirstTokenLead). Only a
request that really runs leads, so nothing is held back for one that cannot (no room,
an image not yet encodable): the rule never stalls the engine. A high-priority
request's first token is then not held up by lower prompts, at the cost of a step's
delay for them each time (docs/performance.md, bench_priority). The running batch's
prompt chunks ranked below the best waiting request are visited after admission
(Scheduler.schedule), so that request's admission step holds none of them when it runs,
and they still run when it is not admitted; nothing ranked no better than them is
admitted ahead of them.

What a better-ranked arrival waits for first is the step already running. With the
engine argument `lower_priority_prefill_tokens`, prompt chunks of requests ranked below
the best-ranked request present (running or waiting) get at most that many tokens a
step, so steps stay short while better-ranked work is around (LowerPrefillCap). Unset:
they share `max_num_batched_tokens` like everyone.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

from backend.engine.request import Request


@dataclass(frozen=True)
class Ranking:
    """(priority, arrival) order; with `aging_s`, the priority less one level per aging_s
    seconds since arrival (on `clock`, the clock of Request.arrival_time)."""
    aging_s: Optional[float] = None
    clock: Callable[[], float] = time.monotonic

    def priority(self, request: Request, now: Optional[float] = None) -> int:
        p = request.sampling_params.priority
        if self.aging_s is None:
            return p
        now = self.clock() if now is None else now
        return p - int(max(0.0, now - request.arrival_time) // self.aging_s)

    def key(self) -> Callable[[Request], tuple[int, float]]:
        now = self.clock() if self.aging_s is not None else None
        return lambda r: (self.priority(r, now), r.arrival_time)


class PriorityQueue:
    """The waiting queue in (priority, arrival) order, with the deque methods the
    scheduler calls: a request put back at the front (preempted, or skipped for this
    step) goes to its place by rank; equal ranks keep their order."""

    def __init__(self, ranking: Ranking = Ranking()) -> None:
        self._items: list[Request] = []
        self.ranking = ranking

    def append(self, request: Request) -> None:
        """A new request: behind the requests of its rank."""
        bisect.insort_right(self._items, request, key=self.ranking.key())

    def appendleft(self, request: Request) -> None:
        """Back to the queue (preempted, or skipped for a step): ahead of its rank's others."""
        bisect.insort_left(self._items, request, key=self.ranking.key())

    def reorder(self) -> None:
        """In order of the aged priorities now (a no-op without aging)."""
        if self.ranking.aging_s is not None:
            self._items = sorted(self._items, key=self.ranking.key())     # (a new list: see Scheduler.schedule)

    def extendleft(self, requests: Iterable[Request]) -> None:
        """Each to the front of its rank, the last first, as deque.extendleft does."""
        for request in requests:
            self.appendleft(request)

    def popleft(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __getitem__(self, index: int) -> Request:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


def in_prompt(request: Request) -> bool:
    """Its next share is a prompt chunk: its prompt, or a preempted request's recompute,
    not yet computed (more than the last token left)."""
    return request.num_computed_tokens + 1 < request.num_tokens


def prompt_ranked_below(request: Request, rank: int, ranking: Ranking, now: Optional[float]) -> bool:
    """A prompt chunk (in_prompt) of a request ranked below `rank`."""
    return in_prompt(request) and ranking.priority(request, now) > rank


class FirstTokenLead:
    """One step's first-token rule: the best (aged) rank whose first token is on its way,
    from a running request whose first token is in flight (async scheduling) or one whose
    prompt chunk the step has scheduled so far. The running batch and then the waiting
    queue are visited in rank order, so a better-ranked prompt is scheduled before the
    lower ones it holds back, and only a request that really runs (or whose token really
    comes) holds anything back: one that cannot run in this step (no room, its image not
    yet encodable, a micro-batch in flight) leaves the others to run."""

    def __init__(self, running: list[Request], ranking: Ranking, now: Optional[float]) -> None:
        self.ranking, self.now = ranking, now
        self.rank = min((ranking.priority(r, now) for r in running
                         if not r.num_output_tokens and r.num_output_placeholders), default=None)

    def sits_out(self, request: Request) -> bool:
        """A prompt chunk (or a preempted request's recompute) ranked below the lead."""
        return self.rank is not None and prompt_ranked_below(request, self.rank, self.ranking, self.now)

    def scheduled(self, request: Request) -> None:
        """The request's share of the step was recorded: a first token on its way leads."""
        if not request.num_output_tokens:
            rank = self.ranking.priority(request, self.now)
            self.rank = rank if self.rank is None else min(self.rank, rank)


class LowerPrefillCap:
    """One step's allowance of prompt tokens for requests ranked below `best`."""

    def __init__(self, tokens: int, best: int, ranking: Ranking, now: Optional[float]) -> None:
        self.left, self.best, self.ranking, self.now = tokens, best, ranking, now

    def clip(self, request: Request, num_new: int) -> int:
        """num_new, cut to what is left of the allowance if this is a lower-ranked prompt
        chunk (0: nothing left). Charged only once the chunk is recorded (charge)."""
        if prompt_ranked_below(request, self.best, self.ranking, self.now):
            return min(num_new, self.left)
        return num_new

    def charge(self, request: Request, num_new: int) -> None:
        if prompt_ranked_below(request, self.best, self.ranking, self.now):
            self.left -= num_new


def insert_running(running: list[Request], request: Request, ranking: Ranking = Ranking()) -> None:
    """Into the running batch at its rank (the batch is scheduled in this order)."""
    bisect.insort_right(running, request, key=ranking.key())


def counts_by_priority(running: list[Request], waiting: Iterable[Request]) -> dict[int, tuple[int, int]]:
    """priority -> (running, waiting): the metrics per priority class. The caller passes
    copies (the engine thread may be changing the queues)."""
    counts: dict[int, list[int]] = {}
    for k, requests in enumerate((running, waiting)):
        for r in requests:
            counts.setdefault(r.sampling_params.priority, [0, 0])[k] += 1
    return {p: (c[0], c[1]) for p, c in counts.items()}
