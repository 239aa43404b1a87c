"""The scheduler's write of a step's result (Scheduler inherits this): tokens appended,
stops checked, placeholders settled, rejected proposals rolled back and newly filled
blocks registered, all by the one writer of request and KV state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from backend.engine.outputs import EngineCoreOutput, ModelRunnerOutput
from backend.engine.request import FinishReason, Request, RequestStatus
from backend.engine.scheduling.sched_output import SchedulerOutput
from backend.engine.scheduling.stop_checker import check_stop
from backend.engine.spec_decode.proposals import Proposals

if TYPE_CHECKING:
    from backend.engine.scheduling.kv_cache_manager import KVCacheManager


class StepResults:
    kv_cache: "KVCacheManager"
    in_flight: set[str]
    num_generation_tokens_total: int
    # The scheduler's own (scheduler.py, spec_decode/proposal_slots.py).
    finish_request: Callable[[Request, FinishReason], None]
    set_proposals: Callable[[Proposals], None]

    def update_from_output(self, out: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """The step's result applied to request and KV state, by the one writer of both:
        the step's placeholder is settled and newly filled blocks are registered; rejected
        proposals roll back (their K/V slots count as not computed, the next step
        overwrites them, and blocks that held only them go back to the pool); each new
        token is appended and checked for a stop on its id as if it came alone (EOS,
        stop ids, the grammar's end, max_tokens, after min_tokens), the first stop ending
        the request there and freeing its blocks. Stop strings are the output side's
        (stop_request). A pooling request whose prompt the step completed finishes with
        its pooled vector. Returns one EngineCoreOutput per request that got tokens or
        finished."""
        outputs = []
        if self.in_flight:                  # (pipeline micro-batches only)
            self.in_flight.difference_update(s.request_id for s in out.scheduled)
        for index, (s, tokens) in enumerate(zip(out.scheduled, result.sampled_token_ids)):
            request = s.request
            s.num_rejected = s.rejected_among(tokens)   # (counted even if it ended meanwhile: the metrics)
            if request.is_finished:
                continue                    # finished or aborted since it was scheduled
            if s.completes_prompt:
                request.num_output_placeholders = max(0, request.num_output_placeholders - 1)
            if request.status == RequestStatus.RUNNING:     # (not preempted since: async scheduling)
                if s.num_rejected:
                    request.num_computed_tokens -= s.num_rejected
                    # The accepted tokens plus the one sampled after them (no K/V yet).
                    self.kv_cache.trim(request, request.num_computed_tokens + 1)
                self.kv_cache.cache_computed_blocks(request)
            if request.pooling:
                pooled = result.pooler_output.get(index)
                if pooled is not None:          # its prompt is computed: done, its blocks free
                    self.finish_request(request, FinishReason.STOP)
                    outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="stop",
                                                    num_cached_tokens=request.num_cached_tokens,
                                                    pooling_output=pooled))
                continue
            prompt_entries = result.prompt_logprobs.get(index)
            if not tokens:
                if prompt_entries:          # a prompt chunk's logprobs
                    outputs.append(EngineCoreOutput(request.request_id, [], new_prompt_logprobs=prompt_entries,
                                                    num_cached_tokens=request.num_cached_tokens))
                continue
            new_tokens, reason = [], None
            for token in tokens:
                request.output_token_ids.append(token)
                new_tokens.append(token)
                reason = check_stop(request, token)
                if reason is not None:
                    break
            self.num_generation_tokens_total += len(new_tokens)
            if len(tokens) > 1 and request.status == RequestStatus.RUNNING:
                self.kv_cache.cache_computed_blocks(request)    # accepted proposals fill blocks too
            entry = result.logprobs.get(index)
            if reason is not None:
                self.finish_request(request, reason)
            outputs.append(EngineCoreOutput(
                request.request_id, new_tokens, [entry] if entry is not None else None,
                prompt_entries, reason.value if reason is not None else None, request.num_cached_tokens,
                kv_transfer_params=request.kv_transfer_params))
        if result.proposals is not None:    # a draft model's, made inside the step
            self.set_proposals(result.proposals)
        return outputs
