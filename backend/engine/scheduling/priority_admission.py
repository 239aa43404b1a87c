"""The scheduler's priority step (scheduling_policy "priority"): what it decides before
the running batch is visited, and the rules each share of the step then follows.

Scheduler inherits this, as it inherits ProposalSlots: it stays the one writer of
request and KV state, and the preemptions made here go through its own `_preempt`. The
rules themselves (ranking, the first-token lead, the lower-prefill allowance) are in
priority.py; this module applies them to one step:
- room is made for the best-ranked waiting requests first (`_make_room_for_waiting`);
- the running batch's prompt chunks ranked below the best waiting request that may be
  admitted in the step are visited after admission (`PriorityStep.defers`), so its
  admission step holds none of them once it runs;
- every share recorded counts for the step's first-token lead and allowance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

from backend.engine.request import Request, RequestStatus
from backend.engine.scheduling.kv_cache_manager import num_device_hits
from backend.engine.scheduling.priority import (FirstTokenLead, LowerPrefillCap, PriorityQueue, Ranking, in_prompt,
                                                prompt_ranked_below)
from backend.engine.scheduling.sched_output import SchedulerOutput

if TYPE_CHECKING:
    from backend.engine.scheduling.kv_cache_manager import KVCacheManager


@dataclass
class PriorityStep:
    """One step's priority rules, decided before anything of it is scheduled."""
    ranking: Ranking
    now: Optional[float]                # the aging clock's reading (None: no aging)
    made_room: set[str]                 # ids preempted for better-ranked waiting requests
    lead: FirstTokenLead
    cap: Optional[LowerPrefillCap]      # with lower_priority_prefill_tokens
    defer_rank: Optional[int]           # running prompts ranked below it wait for admission

    def sits_out(self, request: Request) -> bool:
        """A prompt chunk held back by a better-ranked first token (FirstTokenLead)."""
        return self.lead.sits_out(request)

    def defers(self, request: Request) -> bool:
        """A running prompt chunk to visit after admission."""
        return self.defer_rank is not None and prompt_ranked_below(request, self.defer_rank, self.ranking, self.now)

    def rank(self, request: Request) -> int:
        return self.ranking.priority(request, self.now)

    def recorded(self, request: Request, num_new: int) -> None:
        """A share about to be recorded counts for the first-token rule and the
        allowance. Called before Scheduler._record, as it reads the request as it was."""
        self.lead.scheduled(request)
        if self.cap is not None:
            self.cap.charge(request, num_new)


class PriorityAdmission:
    kv_cache: "KVCacheManager"
    running: list[Request]
    waiting: Union[PriorityQueue, object]
    in_flight: set[str]
    ranking: Ranking
    max_num_seqs: int
    lower_priority_prefill_tokens: Optional[int]
    # The scheduler's own (scheduler.py).
    _preempt: Callable[..., None]
    _running_loras: Callable[[], set[str]]
    _no_adapter_slot: Callable[[Request, set[str]], bool]
    _prefix_hits: Callable[..., Optional[list]]

    def _priority_step(self, out: SchedulerOutput, budget: int, max_batch_seqs: int) -> PriorityStep:
        """The step's rules, after making room for the best-ranked waiting requests."""
        now = None
        if self.ranking.aging_s is not None:
            self.waiting.reorder()
            self.running = sorted(self.running, key=self.ranking.key())    # (new: never seen half-sorted)
            now = self.ranking.clock()
        made_room = self._make_room_for_waiting(out, budget, max_batch_seqs, now)
        candidate = self._admission_candidate(made_room) if any(in_prompt(r) for r in self.running) else None
        return PriorityStep(self.ranking, now, made_room, FirstTokenLead(self.running, self.ranking, now),
                            self._lower_prefill_cap(now),
                            self.ranking.priority(candidate, now) if candidate is not None else None)

    def _make_room_for_waiting(self, out: SchedulerOutput, budget: int, max_batch_seqs: int,
                               now: Optional[float]) -> set[str]:
        """The best-ranked waiting requests (those of the best rank waiting, as the
        first-token rule holds lower ranks back in their step), while they outrank the
        lowest-ranked running request and the step's budget and batch last: while they
        find no room (max_num_seqs reached, or too few free blocks for their next chunks
        after their prefix-cache hits), that running request is preempted (to recompute
        later), before anything of this step is scheduled. So several arrivals of one
        rank are admitted in one step, not one a step. Not for a request that could not
        be admitted in this step anyway (its adapter has no slot, its prompt's blocks are
        being computed, or a better-ranked first token is in flight). Returns the ids
        preempted."""
        preempted: set[str] = set()
        aged = self.ranking.priority
        lead = FirstTokenLead(self.running, self.ranking, now).rank
        loras = self._running_loras()
        rank = None
        seqs = blocks = 0
        for head in list(self.waiting):
            if budget <= 0 or seqs >= max_batch_seqs or not self.running:
                break
            if head.status != RequestStatus.WAITING or head.request_id in self.in_flight:
                continue
            priority = aged(head, now)
            if (rank is not None and priority != rank) or (lead is not None and priority > lead) \
                    or aged(self.running[-1], now) <= priority:
                break                       # (the rest rank no better)
            cached = None if self._no_adapter_slot(head, loras) else self._prefix_hits(head, peek=True)
            if cached is None:
                continue
            rank = priority
            if head.sampling_params.lora_name:
                loras.add(head.sampling_params.lora_name)
            computed = head.num_computed_tokens + len(cached) * self.kv_cache.block_size
            chunk = min(head.num_tokens - computed, budget)
            budget -= chunk
            seqs += 1
            blocks += -(-(computed + chunk) // self.kv_cache.block_size) - num_device_hits(cached)
            while self.running:
                worst = self.running[-1]
                if aged(worst, now) <= priority or worst.request_id in self.in_flight:
                    break                   # never for an equal or a lower priority
                if len(self.running) + seqs <= self.max_num_seqs and self.kv_cache.num_free_blocks >= blocks:
                    break
                self._preempt(worst)
                out.preempted.append(worst)
                preempted.add(worst.request_id)
        return preempted

    def _admission_candidate(self, made_room: set[str]) -> Optional[Request]:
        """The best-ranked waiting request that may be admitted in this step (waiting, not
        in flight nor just preempted, its adapter with a slot, its prompt's blocks not
        being computed), or None."""
        loras = self._running_loras()
        for request in self.waiting:
            if (request.status == RequestStatus.WAITING and request.request_id not in self.in_flight
                    and request.request_id not in made_room and not self._no_adapter_slot(request, loras)
                    and self._prefix_hits(request, peek=True) is not None):
                return request
        return None

    def _lower_prefill_cap(self, now: Optional[float]) -> Optional[LowerPrefillCap]:
        """The step's allowance for prompts ranked below the best present, if capped."""
        if self.lower_priority_prefill_tokens is None or not (self.running or self.waiting):
            return None
        ranks = [self.ranking.priority(q[0], now) for q in (self.running, self.waiting) if q]
        return LowerPrefillCap(self.lower_priority_prefill_tokens, min(ranks), self.ranking, now)
