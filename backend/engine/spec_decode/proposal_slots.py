"""The scheduler's part in speculative decoding: proposals and the KV slots they hold.

The scheduler stays the one writer of request and KV state (Scheduler inherits this);
the proposers only return `Proposals`. A draft model writes K/V ahead of the step it
runs in (the newest token's and its proposals'), inside the runner's step: the scheduler
reserves those slots when it schedules the step (`reserve_lookahead`, vLLM's
num_lookahead_tokens), never preempting anyone for them. With async scheduling, a request that may
speculate (`may_speculate`) sits out the step scheduled while its own is in flight: its
positions (how many proposals stand) and its next proposals (looked up in, or drafted
from, its tokens) are known only when that step's result is in, so it runs every other
step, each verifying its proposals, while the others run every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from backend.engine.request import Request, RequestStatus
from backend.engine.scheduling.sched_output import SchedulerOutput
from backend.engine.spec_decode.proposals import Proposals

if TYPE_CHECKING:
    from backend.engine.scheduling.kv_cache_manager import KVCacheManager


class ProposalSlots:
    kv_cache: "KVCacheManager"
    running: list[Request]
    requests: dict[str, Request]
    # Whether a request may propose tokens (Speculator.can_speculate when speculation is
    # on): such a request is not scheduled while its step is in flight.
    may_speculate: Optional[Callable[[Request], bool]]
    # A draft model's num_speculative_tokens: the slots reserved past a step for what the
    # draft writes ahead in it. 0: no draft model.
    num_lookahead_tokens: int

    def _reclaim_proposal_blocks(self, keep: set[str]) -> bool:
        """Before anyone is preempted: the blocks that running requests other than `keep`
        (those scheduled in this step, and the one being scheduled) hold only for their
        proposals (the draft model writes its proposals' K/V there) go back to the pool,
        and those proposals are dropped. With async scheduling that includes the requests
        skipped because their step is in flight, wherever they stand in the queue: the
        draft then writes only into the slots they still hold. True when a block came back."""
        freed = False
        for r in self.running:
            if r.request_id not in keep and self.kv_cache.num_blocks_beyond(r, r.num_computed_tokens + 1):
                r.spec_token_ids, r.draft_probs = [], None
                self.kv_cache.trim(r, r.num_computed_tokens + 1)
                freed = True
        return freed

    def reserve_lookahead(self, out: SchedulerOutput) -> None:
        """Slots past each scheduled request's tokens for what the draft model writes in
        the step, the newest token's K/V and proposals 1..k-1, for each request that will
        be decoding after it and may speculate: k where the pool has room, else 1 (the
        newest token alone, one proposal), else none. k is bounded by the room max_tokens
        leaves after one new token (the runner bounds it again by the tokens it got)."""
        for s in out.scheduled:
            request = s.request
            if not s.completes_prompt or request.pooling or not self.may_speculate(request):
                continue
            room = request.max_tokens - request.num_output_tokens - request.num_output_placeholders - 1
            k = min(self.num_lookahead_tokens, room)
            for n in ((k, 1) if k > 1 else (k,)):
                if n > 0 and self.kv_cache.allocate_slots(request, n):
                    s.num_lookahead_tokens = n
                    break

    def set_proposals(self, proposals: Proposals) -> None:
        """The speculator's result: each request's proposals for the next step (tokens, the
        draft's distributions or None)."""
        for request_id, (tokens, probs) in proposals.tokens.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids, request.draft_probs = tokens, probs
