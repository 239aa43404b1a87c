"""The scheduler's part in speculative decoding: proposals and the KV slots they hold.

The scheduler stays the one writer of request and KV state (Scheduler inherits this);
the proposers only return `Proposals`. With async scheduling, a request that may
speculate (`may_speculate`) sits out the step scheduled while its own is in flight: its
positions (how many proposals stand) and its next proposals (looked up in, or drafted
from, its tokens) are known only when that step's result is in, so it runs every other
step, each verifying its proposals, while the others run every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from backend.engine.request import Request, RequestStatus
from backend.engine.spec_decode.speculator import Proposals

if TYPE_CHECKING:
    from backend.engine.kv_cache_manager import KVCacheManager


class ProposalSlots:
    kv_cache: "KVCacheManager"
    running: list[Request]
    requests: dict[str, Request]
    # Whether a request may propose tokens (Speculator.can_speculate, set by the engine
    # when speculation is on): such a request is not scheduled while its step is in flight.
    may_speculate: Optional[Callable[[Request], bool]] = None

    def _reclaim_proposal_blocks(self, start: int) -> bool:
        """Before anyone is preempted: the blocks that running requests not yet scheduled
        in this step hold only for their proposals (the draft model writes its proposals'
        K/V there) go back to the pool, and those proposals are dropped. True when a block
        came back."""
        freed = False
        for r in self.running[start:]:
            if self.kv_cache.num_blocks_beyond(r, r.num_computed_tokens + 1):
                r.spec_token_ids, r.draft_probs = [], None
                self.kv_cache.trim(r, r.num_computed_tokens + 1)
                freed = True
        return freed

    def reserve_lookahead(self, eligible: list[tuple[Request, int]]) -> list[tuple[Request, int]]:
        """Slots for what a draft model writes before the next step, the newest token's K/V
        and proposals 1..k-1 (vLLM's num_lookahead_tokens): k where the pool has room, else
        1 (the newest token alone, one proposal), else none for that request."""
        reserved = []
        for request, k in eligible:
            if self.kv_cache.allocate_slots(request, k):
                reserved.append((request, k))
            elif self.kv_cache.allocate_slots(request, 1):
                reserved.append((request, 1))
        return reserved

    def set_proposals(self, proposals: Proposals) -> None:
        """The speculator's result: each request's proposals for the next step (tokens, the
        draft's distributions or None), and how far the draft model's K/V now reaches."""
        for request_id, num in proposals.num_draft_computed.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.num_draft_computed = num
        for request_id, (tokens, probs) in proposals.tokens.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids, request.draft_probs = tokens, probs
