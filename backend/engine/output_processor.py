"""A step's new tokens -> RequestOutputs: each token checked for a stop (EOS, stop ids,
stop strings, the grammar's end, max_tokens) as if it came alone, detokenized
incrementally, logprobs given their text. Several tokens arrive at once when proposals
are accepted (speculative decoding): the first stop ends the request there."""

from __future__ import annotations

from typing import Optional

from backend.engine.detokenizer import IncrementalDetokenizer, fast_decoder
from backend.engine.logprobs import TokenLogprobs
from backend.engine.outputs import RequestOutput
from backend.engine.request import FinishReason, Request
from backend.engine.scheduler import Scheduler


class OutputProcessor:
    def __init__(self, tokenizer, scheduler: Scheduler) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self._fast_decode = fast_decoder(tokenizer)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_generation_tokens_total = 0

    def add(self, request: Request) -> None:
        self.detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params, self._fast_decode)

    def append_tokens(self, request: Request, tokens: list[int], entry: Optional[TokenLogprobs],
                       now: float) -> RequestOutput:
        """A request's new tokens in order, each checked for a stop as if it came alone:
        the first stop ends the request and drops the tokens after it."""
        if request.first_token_time is None:
            request.first_token_time = now
        detok = self.detokenizers[request.request_id]
        emitted, reason, new_logprobs = [], None, None
        for token in tokens:
            request.output_token_ids.append(token)
            emitted.append(token)
            if len(tokens) == 1:        # requests with logprobs do not speculate
                new_logprobs = self._record_logprobs(request, token, entry)
            self.num_generation_tokens_total += 1
            reason = self._check_stop(request, token, detok)
            if reason is not None:
                break
        if len(tokens) > 1:             # accepted proposals fill blocks the prefix cache can take
            self.scheduler.kv_cache.cache_computed_blocks(request)
        if reason is not None:
            self.scheduler.finish_request(request, reason)
            return self.final_output(request, emitted, new_logprobs)
        return RequestOutput(
            request_id=request.request_id, new_token_ids=emitted,
            new_text=detok.take_delta(finished=False), finished=False,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, new_logprobs=new_logprobs,
            cumulative_logprob=request.cumulative_logprob if new_logprobs is not None else None)

    def _record_logprobs(self, request: Request, token: int, entry: Optional[TokenLogprobs]
                         ) -> Optional[list[TokenLogprobs]]:
        """Keeps the token's logprobs on the request, with each token's text (vLLM's
        `decoded_token`); None for a request that did not ask."""
        if entry is None:
            return None
        if self.tokenizer is not None:
            detok = self.detokenizers[request.request_id]  # still before this token
            for tid, lp in entry.items():
                lp.decoded_token = detok.peek(tid)
        request.output_logprobs.append(entry)
        request.cumulative_logprob += entry[token].logprob
        return [entry]

    def _check_stop(self, request: Request, token: int, detok: IncrementalDetokenizer) -> Optional[FinishReason]:
        params = request.sampling_params
        past_min = request.num_output_tokens >= params.min_tokens
        stop_str = detok.add_token(token, check_stop=past_min)
        # The mask let only allowed tokens through; once complete the grammar allows only
        # the stop token, and accepting it ends the request.
        if request.grammar is not None and (not request.grammar.accept_token(token)
                                            or request.grammar.is_terminated()):
            return FinishReason.STOP
        if past_min:
            if not params.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP
            if token in params.stop_token_ids or stop_str is not None:
                return FinishReason.STOP
        if request.num_output_tokens >= request.max_tokens:
            return FinishReason.LENGTH
        return None

    def final_output(self, request: Request, new_token_ids: Optional[list[int]] = None,
                     new_logprobs: Optional[list[TokenLogprobs]] = None) -> RequestOutput:
        """The request's last output (finished, aborted or failed); drops its detokenizer."""
        detok = self.detokenizers.pop(request.request_id)
        wants = request.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id, new_token_ids=new_token_ids or [],
            new_text=detok.take_delta(finished=True), finished=True,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            num_prompt_tokens=request.num_prompt_tokens, num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens, prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids), text=detok.output_text,
            new_logprobs=(new_logprobs or []) if wants else None,
            cumulative_logprob=request.cumulative_logprob if wants else None,
            logprobs=list(request.output_logprobs) if wants else None)
