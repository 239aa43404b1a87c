"""Iteration-level scheduler.

Every step has one token budget (`max_num_batched_tokens`). A request is a number of
computed tokens chasing its number of tokens; there is no separate prefill or decode
phase, so decodes (1 token) and prefill chunks share a step naturally. Running requests
are served first, in admission order, so a long prompt never stalls running decodes;
waiting requests are admitted FIFO only while the budget, `max_num_seqs` and the block
pool allow. When the pool runs dry the most recently admitted request is preempted:
its blocks are freed and it recomputes later (its generated tokens are kept). Under
scheduling_policy "priority" both queues are in (priority, arrival) order instead, so
the lowest-ranked request is the one preempted (priority.py).

Speculative decoding adds a decoding request's proposed tokens to its step (they are
verified in the same forward): budgeted like any token, dropped first when the budget
or the pool is short, and rolled back after the step when rejected.

The class spans three more modules, each one idea, all of it the one writer of request
and KV state: the priority step (priority_admission.py), the write of a step's result
(step_results.py) and the proposals' slots (spec_decode/proposal_slots.py).

With LoRA, a step holds at most `max_loras` distinct adapters (the device's slots): a
waiting request under another adapter waits, and the requests behind it may go first.
So does a waiting request whose prompt blocks another request computes in this step
(prefix caching registers them when scheduled): it is admitted in the next step and
shares them, so `n` > 1 children compute their prompt once.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Union

from backend.engine.errors import InvalidRequestError
from backend.engine.scheduling.encoder_cache import EncoderCacheManager
from backend.engine.scheduling.kv_cache_manager import KVCacheManager
from backend.engine.scheduling.kv_handoff import KVHandoff
from backend.engine.outputs import EngineCoreOutput
from backend.engine.request import FinishReason, Request, RequestStatus
from backend.engine.scheduling.priority import PriorityQueue, Ranking, insert_running
from backend.engine.scheduling.priority_admission import PriorityAdmission, PriorityStep
from backend.engine.scheduling.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from backend.engine.spec_decode.proposal_slots import ProposalSlots
from backend.engine.scheduling.step_results import StepResults
from backend.engine.structured_output.structured_output_manager import StructuredOutputManager
from backend.models.rotary import long_rope_salt


class Scheduler(ProposalSlots, PriorityAdmission, StepResults):
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: Optional[int] = None, structured: Optional[StructuredOutputManager] = None,
                 long_rope_original: Optional[int] = None,
                 may_speculate: Optional[Callable[[Request], bool]] = None, num_lookahead_tokens: int = 0,
                 policy: str = "fcfs", ranking: Ranking = Ranking(), handoff: Optional[KVHandoff] = None,
                 encoder: Optional[EncoderCacheManager] = None, lower_priority_prefill_tokens: Optional[int] = None
                 ) -> None:
        self.kv_cache = kv_cache
        # Vision-language models: the images each step encodes (encoder_cache.py).
        self.encoder = encoder
        # Prefill/decode disaggregation: a finished request that asks keeps its blocks for
        # a decode engine (kv_handoff.py).
        self.handoff = handoff
        # Structured output (structured_output_manager.py): grammars compiled for guided
        # requests, which wait as WAITING_FOR_GRAMMAR until theirs is ready.
        self.structured = structured
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # "fcfs", or "priority": both queues in (priority, arrival) order (priority.py).
        self.policy = policy
        self.ranking = ranking      # (with priority_aging_s: priorities improve as requests wait)
        self.lower_priority_prefill_tokens = lower_priority_prefill_tokens     # (priority.LowerPrefillCap)
        self.waiting: Union[deque[Request], PriorityQueue] = PriorityQueue(ranking) if policy == "priority" \
            else deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Steps in which a prompt was cut short by the token budget (chunked prefill).
        self.num_chunked_prefills = 0
        self.num_generation_tokens_total = 0
        # LongRoPE models: original_max_position_embeddings (backend/models/rotary.py).
        self.long_rope_original = long_rope_original
        # Speculative decoding (spec_decode/proposal_slots.py): which requests may propose
        # tokens, and a draft model's lookahead slots.
        self.may_speculate = may_speculate
        self.num_lookahead_tokens = num_lookahead_tokens
        self.num_long_rope_restarts = 0
        # Pipeline micro-batches (backend/engine/scheduling/batch_queue.py): when set, the requests of
        # steps scheduled but not yet updated are in flight and left out of later steps.
        self.exclude_in_flight = False
        self.in_flight: set[str] = set()
        # The runner's side of the typed step (sched_output.py): the requests it holds a
        # state for, and those finished since its last step (sent with the next one).
        self._runner_holds: set[str] = set()
        self._finished_req_ids: list[str] = []

    # ----------------------------------------------------------------- requests
    def add_request(self, request: Request) -> None:
        """Queues the request; a guided one waits for its grammar (which may refuse it:
        InvalidRequestError, QueueFullError, raised before it is queued)."""
        if request.sampling_params.guided_fields():
            if self.structured is None:
                raise InvalidRequestError("structured output is not available on this engine")
            self.structured.submit(request)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def update_grammars(self, wait_s: float = 0.0) -> list[EngineCoreOutput]:
        """Guided requests whose grammar is ready may be admitted from now on; those whose
        grammar failed (or ran past its time limit) end with the error."""
        if self.structured is None or not self.structured.num_compiling:
            return []
        ready, failed = self.structured.update(wait_s)
        for request in ready:
            request.status = RequestStatus.WAITING
        outputs = []
        for request, error in failed:
            self.finish_request(request, FinishReason.ABORT)
            outputs.append(EngineCoreOutput(request.request_id, [], finish_reason="abort", error=error))
        return outputs

    def abort_request(self, request_id: str) -> Optional[Request]:
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return None
        self.finish_request(request, FinishReason.ABORT)
        return request

    def finish_request(self, request: Request, reason: FinishReason) -> None:
        """Finish a request and free its blocks at once."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR):
            self.waiting.remove(request)
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.structured.cancel(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request.request_id in self._runner_holds:
            self._runner_holds.discard(request.request_id)
            self._finished_req_ids.append(request.request_id)
        if self.encoder is not None:
            self.encoder.release(request)
        transfer = request.sampling_params.kv_transfer_params
        if transfer and transfer.get("do_remote_decode") and reason != FinishReason.ABORT and self.handoff:
            block_ids = self.handoff.hold(request)
            request.kv_transfer_params = {"remote_block_ids": block_ids,
                                          "num_remote_tokens": len(block_ids) * self.kv_cache.block_size}
        self.kv_cache.free(request)
        del self.requests[request.request_id]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    @property
    def has_finished_unsent(self) -> bool:
        """Requests finished since the last step whose ids the runner has not had (an idle
        engine hands them over in an empty step: LLMEngine.after_step)."""
        return bool(self._finished_req_ids)

    def lora_stats(self) -> dict:
        """The adapters of running and of waiting requests, by name (vLLM's
        `lora_requests_info`). Read from the metrics thread: each queue is copied in one
        C-level call first, as the engine thread may be changing it."""
        def names(requests: list[Request]) -> list[str]:
            return sorted({r.sampling_params.lora_name for r in requests} - {None})
        return {"running_lora_adapters": names(list(self.running)),
                "waiting_lora_adapters": names(list(self.waiting)), "max_loras": self.max_loras}

    # -------------------------------------------------------------- scheduling
    def schedule(self, max_batch_seqs: Optional[int] = None) -> SchedulerOutput:
        """max_batch_seqs: at most this many requests in the step (a micro-batch's share)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.encoder is not None:
            self.encoder.begin_step()
        max_batch_seqs = max_batch_seqs or self.max_num_seqs

        # Priority: room made for the best-ranked waiting requests, and the step's rules
        # (priority_admission.py). Requests preempted for them are not admitted again in
        # this step (their step in flight is still to come back).
        rules = self._priority_step(out, budget, max_batch_seqs) if self.policy == "priority" else None
        made_room = rules.made_room if rules is not None else set()
        deferred: list[Request] = []
        for request in list(self.running):          # (a copy: preemption takes from its end)
            if budget <= 0 or len(out.scheduled) >= max_batch_seqs:
                break
            if request.status != RequestStatus.RUNNING:
                continue                    # preempted in this step
            if rules is not None and rules.defers(request):
                deferred.append(request)
                continue
            budget -= self._schedule_running(out, request, budget, rules)

        deferred_floor = min((rules.rank(r) for r in deferred), default=None)
        can_admit = len(out.preempted) == len(made_room)    # (not when the pool ran dry for running ones)
        loras = self._running_loras()
        skipped: list[Request] = []
        while (can_admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and len(out.scheduled) < max_batch_seqs):
            request = self.waiting[0]
            if rules is not None and rules.sits_out(request):
                break                       # (the rest rank no better)
            if deferred and rules.rank(request) >= deferred_floor:
                break                       # no better than a deferred prompt (nor are the rest)
            if request.request_id in self.in_flight or request.request_id in made_room:
                skipped.append(self.waiting.popleft())      # preempted while in flight: after its result
                continue
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                skipped.append(self.waiting.popleft())      # admitted once its grammar is ready
                continue
            if self._no_adapter_slot(request, loras):
                skipped.append(self.waiting.popleft())      # its adapter has no slot this step
                continue
            if self._past_long_rope_context(request, request.num_tokens):
                self._enter_long_rope(request)      # preempted while short, longer since
            cached = self._prefix_hits(request)
            if cached is None:
                # Its prompt's blocks are being computed in this step (by a sibling or a
                # request with the same prefix): it shares them from the next step on.
                skipped.append(self.waiting.popleft())
                continue
            num_computed = request.num_computed_tokens + len(cached) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            if rules is not None and rules.cap is not None:
                num_new = rules.cap.clip(request, num_new)
                if not num_new:
                    break                   # the allowance is spent (the rest rank no better)
            plan = self._encoder_plan(request, num_computed, num_new)
            if plan is not None:
                if not plan.num_new_tokens:
                    skipped.append(self.waiting.popleft())      # its first image waits for the budget
                    continue
                num_new = plan.num_new_tokens
            if not self.kv_cache.allocate_slots(request, num_new, cached):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_computed
            self._commit_encoder(out, request, plan)
            request.num_cached_tokens = len(cached) * self.kv_cache.block_size
            request.status = RequestStatus.RUNNING
            if self.policy == "priority":
                insert_running(self.running, request, self.ranking)
            else:
                self.running.append(request)
            if request.sampling_params.lora_name:
                loras.add(request.sampling_params.lora_name)
            out.new_requests.append(NewRequestData.of(request, resumed=request.request_id in self._runner_holds))
            self._runner_holds.add(request.request_id)
            if rules is not None:
                rules.recorded(request, num_new)
            self._record(out, request, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        for request in deferred:
            if budget <= 0 or len(out.scheduled) >= max_batch_seqs:
                break
            if request.status == RequestStatus.RUNNING:
                budget -= self._schedule_running(out, request, budget, rules)
        if self.num_lookahead_tokens:
            self.reserve_lookahead(out)
        self.kv_cache.set_block_diffs(out)          # (after every allocation of the step)
        if self.encoder is not None:
            out.encoder_frees = self.encoder.take_freed()
        if out.scheduled and self.kv_cache.connector is not None:
            out.kv_transfers = self.kv_cache.take_transfers()   # (kept for a step that runs)
        if self.exclude_in_flight:
            self.in_flight.update(s.request_id for s in out.scheduled)
        out.finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
        out.preempted_req_ids = [r.request_id for r in out.preempted]
        return out

    def _schedule_running(self, out: SchedulerOutput, request: Request, budget: int,
                          rules: Optional[PriorityStep]) -> int:
        """A running request's share of the step, preempting the lowest-ranked running
        requests not yet scheduled when the pool is short (the request itself last).
        Returns the tokens scheduled (0: none this step)."""
        if request.request_id in self.in_flight or (rules is not None and rules.sits_out(request)):
            return 0                        # in another micro-batch still in flight, or sits out
        if request.num_output_placeholders and (
                request.num_output_tokens + request.num_output_placeholders >= request.max_tokens):
            return 0                        # its step in flight brings its last token
        if request.num_output_placeholders and self.may_speculate is not None and self.may_speculate(request):
            return 0                        # its next step needs its step in flight's result
        if self._past_long_rope_context(request, request.num_tokens + request.num_output_placeholders):
            # Its next token lies past LongRoPE's original context: like transformers,
            # recompute the whole sequence with the long frequencies.
            self._preempt(request, long_rope_restart=True)
            out.preempted.append(request)
            return 0
        self.kv_cache.free_outside_window(request)
        num_new = min(request.num_tokens + request.num_output_placeholders + len(request.spec_token_ids)
                      - request.num_computed_tokens, budget)
        if rules is not None and rules.cap is not None:
            num_new = rules.cap.clip(request, num_new)
            if not num_new:
                return 0                    # its allowance is spent (priority.LowerPrefillCap)
        plan = self._encoder_plan(request, request.num_computed_tokens, num_new)
        if plan is not None:
            if not plan.num_new_tokens:
                return 0                    # its next image waits for the vision tower's budget
            num_new = plan.num_new_tokens
        if request.spec_token_ids and not self.kv_cache.allocate_slots(request, num_new):
            # Proposals are optional: never preempt anyone to verify them.
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            request.spec_token_ids = []
        while not self.kv_cache.allocate_slots(request, num_new):
            scheduled = {s.request_id for s in out.scheduled}
            if self._reclaim_proposal_blocks({request.request_id, *scheduled}):
                continue
            if any(r.request_id in scheduled for r in self.running[self.running.index(request) + 1:]):
                # (Only for a deferred prompt, visited after requests that come later in
                # the batch: it waits for a step rather than undo theirs or preempt others.)
                return 0
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return 0                    # (everything after it was preempted first)
        self._commit_encoder(out, request, plan)
        if rules is not None:
            rules.recorded(request, num_new)
        self._record(out, request, num_new)
        return num_new

    def _encoder_plan(self, request: Request, start: int, num_new: int):
        """Vision-language models: the chunk cut before an image the step cannot encode."""
        if self.encoder is None or request.mm_inputs is None:
            return None
        return self.encoder.plan(request, start, num_new)

    def _commit_encoder(self, out: SchedulerOutput, request: Request, plan) -> None:
        if plan is not None:
            self.encoder.commit(request, plan)
            out.encoder_inputs.extend(plan.encode)

    def _running_loras(self) -> set[str]:
        """The adapters of the running batch, by name."""
        return {r.sampling_params.lora_name for r in self.running} - {None}

    def _no_adapter_slot(self, request: Request, loras: set[str]) -> bool:
        """Its adapter is not among `loras` (those of the step) and they fill max_loras."""
        lora = request.sampling_params.lora_name
        return bool(lora) and lora not in loras and self.max_loras is not None and len(loras) >= self.max_loras

    def _prefix_hits(self, request: Request, peek: bool = False) -> Optional[list]:
        """The cached blocks a waiting request starts from ([] when it has computed tokens
        of its own); None while its prompt's blocks are being computed in this step. A
        request with prompt logprobs computes the positions it still needs (vLLM skips
        the prefix cache for it): hits only below them. peek: for a look ahead at
        admission (KVCacheManager.find_cached_blocks: nothing counted)."""
        if request.num_computed_tokens:
            return []
        return self.kv_cache.find_cached_blocks(
            request, max_tokens=request.num_prompt_logprob_rows
            if request.num_prompt_logprob_rows < request.prompt_logprob_rows_end else None, peek=peek)

    def _record(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        """The request's share of the step; its tokens count as computed from now on (the
        next step, scheduled before this one's result with async scheduling, starts
        after them), and a token it samples is a placeholder until the result arrives."""
        num_spec = max(0, request.num_computed_tokens + num_new - request.num_tokens - request.num_output_placeholders)
        spec = request.spec_token_ids[:num_spec] if num_spec else []
        probs = request.draft_probs[:num_spec] if spec and request.draft_probs is not None else None
        request.spec_token_ids, request.draft_probs = [], None      # proposals are used once
        scheduled = ScheduledRequest(request, num_new, spec, probs)
        start = max(request.num_computed_tokens, request.num_prompt_logprob_rows)
        end = min(request.num_computed_tokens + num_new, request.prompt_logprob_rows_end)
        if end > start:
            scheduled.prompt_logprob_start, scheduled.num_prompt_logprob_rows = start, end - start
            request.num_prompt_logprob_rows = end
        if not scheduled.completes_prompt:
            self.num_chunked_prefills += 1
        out.scheduled.append(scheduled)
        request.num_computed_tokens += num_new
        if scheduled.completes_prompt and not request.pooling:     # (a pooling request samples nothing)
            request.num_output_placeholders += 1

    def _preempt(self, request: Request, long_rope_restart: bool = False) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        if self.encoder is not None:
            self.encoder.release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0     # a token in flight still arrives (update_from_output)
        request.spec_token_ids, request.draft_probs = [], None
        if long_rope_restart:
            self._enter_long_rope(request)
            self.num_long_rope_restarts += 1
        else:
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _past_long_rope_context(self, request: Request, num_tokens: int) -> bool:
        """A LongRoPE request still in short mode holding more tokens than the original
        context (backend/models/rotary.py): it must be computed in long mode."""
        return (self.long_rope_original is not None and not request.long_rope
                and num_tokens > self.long_rope_original)

    @staticmethod
    def _enter_long_rope(request: Request) -> None:
        """Long mode, for a request that holds no KV: its own prefix-cache chain."""
        request.long_rope, request.cache_salt = True, long_rope_salt(request.cache_salt)
        request.block_hashes = []           # the chain starts again from the new salt

    def grammar_bitmask(self, out: SchedulerOutput):
        """The step's grammar bitmask for the runner's draw (structured output): a row per
        sampled logits row (k + 1 for a request verifying k proposals), from the
        request's matcher as it is now, which with async scheduling has accepted the
        step before's tokens; no row for a request that finished since. None when no row
        is guided."""
        if self.structured is None or not self.structured.started:
            return None
        guided: list[tuple[int, Request]] = []
        num_rows = 0
        for s in out.scheduled:
            if s.completes_prompt:
                k = len(s.spec_token_ids) + 1
                r = s.request
                if r.grammar is not None and r.reasoning_ended and not r.is_finished:
                    guided += [(num_rows + j, r) for j in range(k)]
                num_rows += k
        return self.structured.bitmask(num_rows, guided) if guided else None

    def stop_request(self, request_id: str) -> None:
        """A stop string ended the request (found by the output side, on text): finished
        with "stop", its blocks free at once. A no-op when it has finished already."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, FinishReason.STOP)
