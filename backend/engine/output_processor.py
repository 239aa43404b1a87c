"""The output side: EngineCoreOutputs (token ids) -> RequestOutputs (text). Each token is
detokenized incrementally and checked for the request's stop strings as if it came
alone; logprobs get their text and a running sum. Several tokens arrive at once when
proposals are accepted (speculative decoding): a stop string ends the request at the
token that completes it and drops the tokens after it.

Nothing here reads or writes engine state: each request's token ids, logprobs and text
are this side's own copy, so it can run on another thread than the engine's
(engine_loop.py). A stop string is the one thing that flows back: `process` returns the
ids of the requests it stopped, and the engine finishes them (Scheduler.stop_request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from backend.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from backend.engine.sampling.logprobs import TokenLogprobs
from backend.engine.outputs import EngineCoreOutput, RequestOutput
from backend.sampling_params import SamplingParams


@dataclass
class _RequestState:
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: the entries so far (None first), their texts from
    # a detokenizer over the prompt; given out once complete, with the first token.
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    prompt_detokenizer: Optional[IncrementalDetokenizer] = None
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._fast_decode = fast_decoder(tokenizer)
        self._states: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        state = self._states[request_id] = _RequestState(
            prompt_token_ids, params,
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, self._fast_decode))
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
            state.prompt_detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids[:1], params.model_copy(update={"stop": []}), self._fast_decode)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def __len__(self) -> int:
        return len(self._states)

    def process(self, core_outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The RequestOutputs of a step, and the ids of the requests a stop string ended
        (still running in the engine: it must stop them). Outputs of requests this side
        no longer tracks (a stop string ended them while the engine ran on) are dropped."""
        outputs, stopped = [], []
        for core in core_outputs:
            state = self._states.get(core.request_id)
            if state is None:
                continue
            out = self._process_one(core, state)
            if out is None:
                continue
            outputs.append(out)
            if out.finished and not core.finished:
                stopped.append(core.request_id)
        return outputs, stopped

    def _process_one(self, core: EngineCoreOutput, state: _RequestState) -> Optional[RequestOutput]:
        """The request's output for this core output; None for a prompt chunk's logprobs
        alone (kept until the first token)."""
        detok, params = state.detokenizer, state.params
        state.num_cached_tokens = core.num_cached_tokens
        if core.new_prompt_logprobs:
            self._record_prompt_logprobs(state, core.new_prompt_logprobs)
            if not core.new_token_ids and not core.finished and core.error is None:
                return None
        new_logprobs = None
        finish_reason = core.finish_reason
        emitted = core.new_token_ids
        for i, token in enumerate(core.new_token_ids):
            if core.new_logprobs is not None and i < len(core.new_logprobs):
                new_logprobs = new_logprobs or []
                new_logprobs.append(self._record_logprobs(state, token, core.new_logprobs[i]))
            state.token_ids.append(token)
            past_min = len(state.token_ids) >= params.min_tokens
            if detok.add_token(token, check_stop=past_min) is not None:
                emitted, finish_reason = core.new_token_ids[:i + 1], "stop"
                break
        if finish_reason is not None or core.error is not None:
            out = self.final_output(core.request_id, finish_reason or "abort", emitted, new_logprobs, core.error)
            out.pooling_output = core.pooling_output
            out.kv_transfer_params = core.kv_transfer_params
            return out
        return RequestOutput(
            request_id=core.request_id, new_token_ids=emitted,
            new_text=detok.take_delta(finished=False), finished=False,
            num_prompt_tokens=len(state.prompt_token_ids), num_output_tokens=len(state.token_ids),
            num_cached_tokens=state.num_cached_tokens, new_logprobs=new_logprobs,
            cumulative_logprob=state.cumulative_logprob if new_logprobs is not None else None,
            prompt_logprobs=self._first_prompt_logprobs(state))

    def _record_prompt_logprobs(self, state: _RequestState, entries: list[TokenLogprobs]) -> None:
        """Appends the next positions' entries, with each candidate's text: what it would
        add after the prompt tokens before it (so the prompt tokens' texts spell the
        prompt after its first token)."""
        detok = state.prompt_detokenizer
        for entry in entries:
            position = len(state.prompt_logprobs)
            if self.tokenizer is not None:
                for tid, lp in entry.items():
                    lp.decoded_token = detok.peek(tid)
            detok.add_token(state.prompt_token_ids[position], check_stop=False)
            state.prompt_logprobs.append(entry)

    @staticmethod
    def _first_prompt_logprobs(state: _RequestState) -> Optional[list[Optional[TokenLogprobs]]]:
        """The whole list, on the first output that asks after the prompt is done."""
        if state.prompt_logprobs is None or state.prompt_logprobs_sent:
            return None
        state.prompt_logprobs_sent = True
        return list(state.prompt_logprobs)

    def _record_logprobs(self, state: _RequestState, token: int, entry: TokenLogprobs) -> TokenLogprobs:
        """Keeps the token's logprobs, with each candidate's text (vLLM's
        `decoded_token`, what add_token would add now: the rank-1 texts spell the output)."""
        if self.tokenizer is not None:
            for tid, lp in entry.items():
                lp.decoded_token = state.detokenizer.peek(tid)
        state.logprobs.append(entry)
        state.cumulative_logprob += entry[token].logprob
        return entry

    def discard(self, request_id: str) -> None:
        """Forgets the request without an output (its consumer is gone)."""
        self._states.pop(request_id, None)

    def final_output(self, request_id: str, finish_reason: Optional[str],
                     new_token_ids: Optional[list[int]] = None,
                     new_logprobs: Optional[list[TokenLogprobs]] = None,
                     error: Optional[Exception] = None) -> RequestOutput:
        """The request's last output (finished, aborted or failed); forgets the request."""
        state = self._states.pop(request_id)
        detok = state.detokenizer
        wants = state.params.logprobs is not None
        return RequestOutput(
            request_id=request_id, new_token_ids=new_token_ids or [],
            new_text=detok.take_delta(finished=True), finished=True, finish_reason=finish_reason,
            num_prompt_tokens=len(state.prompt_token_ids), num_output_tokens=len(state.token_ids),
            num_cached_tokens=state.num_cached_tokens, prompt_token_ids=state.prompt_token_ids,
            token_ids=list(state.token_ids), text=detok.output_text,
            new_logprobs=(new_logprobs or []) if wants else None,
            cumulative_logprob=state.cumulative_logprob if wants else None,
            logprobs=list(state.logprobs) if wants else None, error=error,
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None)
