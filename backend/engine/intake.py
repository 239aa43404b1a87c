"""Requests into and out of the engine, outside the step: each request checked once
(limits, prompt, max_tokens against max_model_len, LoRA adapter, queue size) with an
error that names what is wrong, then handed to the scheduler (a guided one waits there
for its grammar), its deadline kept; aborts and the output side's stop-string hits. Part of LLMEngine (a mixin over
its state: scheduler, limits, outputs, deadlines).

The text work (the prompt's tokens, the bad words') is `prepare`, which touches no
engine state: EngineLoop runs it on the caller's thread, so the engine thread only
checks and schedules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union


from backend.engine.sampling.bad_words import BadWords, resolve as resolve_bad_words
from backend.engine.errors import (DeadlineExceededError, EngineSleepingError, InvalidRequestError, QueueFullError,
                                   check_token_ids)
from backend.engine.outputs import EngineCoreOutput, RequestOutput
from backend.engine.request import Request
from backend.engine.sampling.sampling_row import SamplingRow
from backend.sampling_params import SamplingParams

# Text, token ids, or vLLM's prompt dict: {"prompt": text} or {"prompt_token_ids": ids},
# with "multi_modal_data": {"image": [...]} for a vision-language model.
Prompt = Union[str, Sequence[int], dict[str, Any]]


@dataclass
class PreparedPrompt:
    """A request's text work, done before the engine takes it. An error is kept, not
    raised, so that the intake reports a request's problems in its usual order."""
    token_ids: Optional[list[int]]
    bad_words: Optional[BadWords]
    prompt_error: Optional[Exception] = None
    bad_words_error: Optional[Exception] = None
    mm_inputs: Optional[object] = None      # the prompt's images (backend/multimodal/inputs.py)


class RequestIntake:
    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this checkpoint has no tokenizer files: send token ids (input_ids) instead of text")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def prepare(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> PreparedPrompt:
        """The prompt's token ids and the bad words' sequences. Reads the tokenizer and the
        model's config only: safe on any thread."""
        prepared = PreparedPrompt(None, None)
        try:
            prepared.bad_words = resolve_bad_words(params or SamplingParams(), self.tokenizer,
                                                   self.model_config.vocab_size)
        except Exception as e:          # (raised where the intake checks bad words)
            prepared.bad_words_error = e
        try:
            prepared.token_ids, prepared.mm_inputs = self._prompt_inputs(prompt)
        except Exception as e:
            prepared.prompt_error = e
        return prepared

    def _prompt_inputs(self, prompt: Prompt) -> tuple[list[int], Optional[object]]:
        """Token ids and images of a prompt (the images' processing is here: off the
        engine thread)."""
        if not isinstance(prompt, dict):
            return self.tokenize(prompt), None
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown:
            raise InvalidRequestError(f"unknown prompt field '{unknown[0]}' (expected prompt or prompt_token_ids, "
                                      "and multi_modal_data)")
        if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise InvalidRequestError("a prompt dict needs exactly one of 'prompt' and 'prompt_token_ids'")
        mm_data = prompt.get("multi_modal_data")
        text = prompt.get("prompt")
        if mm_data and isinstance(text, str) and self.vision is not None:
            text = self.vision.processor.expand_text(text)      # (Gemma 3 places images in the text)
        token_ids = self.tokenize(text if "prompt" in prompt else prompt["prompt_token_ids"])
        if not mm_data:
            return token_ids, None
        if self.vision is None:
            raise InvalidRequestError(f"this model ({self.model_config.architecture}) does not accept images")
        return self.vision.process(token_ids, mm_data)

    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, arrival_time: Optional[float] = None) -> Request:
        """A request into the engine, its output side inline (step's RequestOutputs)."""
        request = self.add_core_request(prompt, params, request_id, arrival_time)
        self.outputs.add(request.request_id, request.prompt_token_ids, request.sampling_params)
        return request

    def add_core_request(self, prompt: Union[Prompt, PreparedPrompt], params: Optional[SamplingParams] = None,
                         request_id: Optional[str] = None, arrival_time: Optional[float] = None) -> Request:
        """A request into the engine alone: its outputs come out of core_step, for an
        output side elsewhere (engine_loop.py). `prompt` may come prepared (`prepare`, on
        the caller's thread). Raises on a request the engine refuses."""
        params = params or SamplingParams()
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self.prepare(prompt, params)
        self.limits.check(params)
        if params.n != 1:
            raise InvalidRequestError(f"sampling parameter 'n' is {params.n}: the engine runs one sequence per request; "
                                      "fan n > 1 out with backend.engine.parallel_sampling.child_requests")
        if self.sleep_mode.is_sleeping:
            raise EngineSleepingError("the engine is asleep (sleep mode): wake it up (POST /wake_up), then retry")
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        if params.priority != 0 and self.args.scheduling_policy != "priority":
            raise InvalidRequestError(f"sampling parameter 'priority' is {params.priority}, but the engine schedules "
                                      "first come, first served: priority needs the engine argument "
                                      "scheduling_policy 'priority'")
        if params.kv_transfer_params is not None and (self.handoff is None or not self.handoff.holding):
            # (each such request keeps its blocks after it ends: only a prefill engine's
            # own handler may ask, never any client of an ordinary engine)
            raise InvalidRequestError("sampling parameter 'kv_transfer_params' is for the prefill engine of a "
                                      "disaggregated deployment (docs/dynamo.md); this engine is not one")
        max_queue = self.args.max_queue_size
        if max_queue is not None and len(self.scheduler.waiting) >= max_queue:
            raise QueueFullError(f"waiting queue is full (max_queue_size={max_queue})")
        if params.lora_name is not None:
            if self.lora is None:
                raise InvalidRequestError(f"sampling parameter 'lora_name' is '{params.lora_name}', but LoRA is not "
                                          "enabled on this model (engine arguments enable_lora, lora_modules)")
            self.lora.check_request(params.lora_name)
        pooling = self.args.runner == "pooling"
        if pooling and params.guided_fields():
            raise InvalidRequestError("this is an embedding model (runner 'pooling'): it generates no text, so "
                                      f"structured output ('{params.guided_fields()[0]}') does not apply")
        if pooling and params.prompt_logprobs is not None:
            raise InvalidRequestError("this is an embedding model (runner 'pooling'): it computes no logits, so "
                                      "sampling parameter 'prompt_logprobs' does not apply")
        if prepared.bad_words_error is not None:
            raise prepared.bad_words_error
        bad_words = prepared.bad_words
        self._validate_logit_bias(params)
        if prepared.prompt_error is not None:
            raise prepared.prompt_error
        token_ids = prepared.token_ids
        self._validate_prompt(token_ids, room_for_output=not pooling)
        check_token_ids(params.reasoning_end_token_ids or (), self.model_config.vocab_size,
                        "sampling parameter 'reasoning_end_token_ids'")
        # A pooling request samples nothing: its sampling limits do not apply.
        max_tokens = 1 if pooling else self._effective_max_tokens(len(token_ids), params)
        eos = frozenset(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and not eos:
            eos = frozenset([self.tokenizer.eos_token_id])
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            arrival_time=arrival_time or self.clock(), max_tokens=max_tokens,
            eos_token_ids=eos, bad_words=bad_words, reasoning_ended=not params.reasoning_end_token_ids,
            cache_salt=self.lora.salt(params.lora_name) if self.lora is not None else None, pooling=pooling,
            mm_inputs=prepared.mm_inputs,
            sampling_row=SamplingRow.of(params, eos, self.model_config.vocab_size))
        self.scheduler.add_request(request)     # a guided one waits there for its grammar
        deadline = self.limits.deadline(params)
        if deadline is not None:
            self._deadlines.push(request.arrival_time + deadline[0], (request, *deadline))
        self.num_prompt_tokens_total += len(token_ids)
        return request

    def new_request_id(self) -> str:
        """An id no request of this engine was given by default before."""
        return f"req-{next(self._ids)}"

    def _expire_deadlines(self, now: float) -> list[EngineCoreOutput]:
        """Aborts the requests whose deadline has passed, wherever they are (waiting,
        running, awaiting their grammar): their blocks are free on return and each final
        output carries a DeadlineExceededError. One heap peek when none is due."""
        outputs = []
        for request, timeout_s, source in self._deadlines.pop_due(now):
            if request.is_finished or not self._is_current(request):
                continue                        # finished first (or its id now names another)
            out = self.abort_core(request.request_id)
            if out is None:
                continue
            out.error = DeadlineExceededError(
                f"request '{request.request_id}' exceeded its deadline: request_timeout_s={timeout_s:g} s "
                f"({source}) after arrival; aborted after {request.num_output_tokens} generated tokens")
            outputs.append(out)
        if len(self._deadlines) > 2 * self.scheduler.num_unfinished + 1024:
            self._deadlines.compact(lambda entry: not entry[0].is_finished)
        return outputs

    def _is_current(self, request: Request) -> bool:
        rid = request.request_id
        return self.scheduler.requests.get(rid) is request

    def _validate_prompt(self, token_ids: list[int], room_for_output: bool = True) -> None:
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        check_token_ids(token_ids, self.model_config.vocab_size)
        if not room_for_output and len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}")
        if room_for_output and len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token")

    def _validate_logit_bias(self, params: SamplingParams) -> None:
        # The sampler can only bias ids it has logits for: another id was silently ignored.
        check_token_ids(sorted(params.logit_bias or ()), self.model_config.vocab_size,
                        "sampling parameter 'logit_bias'")

    def _effective_max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        room = self.max_model_len - prompt_len
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} with a {prompt_len}-token prompt exceeds "
                f"max_model_len={self.max_model_len} (at most {room} new tokens)")
        return params.max_tokens

    def abort_core(self, request_id: str) -> Optional[EngineCoreOutput]:
        """Abort now, on the engine side alone; the request's blocks are free when this
        returns. None when it is not (or no longer) in the engine."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return None
        if self.speculator is not None:
            self.speculator.forget([request_id])
        return EngineCoreOutput(request_id, [], finish_reason="abort", num_cached_tokens=request.num_cached_tokens)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Abort now; the request's blocks are free when this returns. Its final output,
        or None when it had finished."""
        core = self.abort_core(request_id)
        if core is None or request_id not in self.outputs:
            return None
        return self.outputs.final_output(request_id, "abort")

    def abort_all(self) -> None:
        """Abort every request the engine holds (shutdown): every block is free on return."""
        self._in_flight = None          # its result would be dropped: every request ends
        for request_id in list(self.scheduler.requests):
            self.abort_core(request_id)

    def stop_requests(self, request_ids: list[str]) -> None:
        """The output side found a stop string in these requests' text: they end with
        "stop" (their blocks free at once). Those that finished meanwhile are skipped."""
        for request_id in request_ids:
            self.scheduler.stop_request(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_ids)

