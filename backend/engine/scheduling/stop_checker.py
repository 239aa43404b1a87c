"""The stops a generated token causes, on token ids (vLLM's check_stop): EOS, stop ids,
the grammar's end, max_tokens, after min_tokens. Stop strings are text: the output
side's (output_processor.py). Called by the scheduler alone, as it appends each token."""

from __future__ import annotations

from typing import Optional

from backend.engine.request import FinishReason, Request


def check_stop(request: Request, token: int) -> Optional[FinishReason]:
    """The stop a just-appended token causes, on token ids (stop strings are text:
    the output side's)."""
    params = request.sampling_params
    # The mask let only allowed tokens through; once complete the grammar allows only
    # the stop token, and accepting it ends the request. While the reply still reasons
    # the grammar waits for the reasoning's end.
    if request.grammar is not None:
        if not request.reasoning_ended:
            end = params.reasoning_end_token_ids
            request.reasoning_ended = request.output_token_ids[-len(end):] == end
        elif not request.grammar.accept_token(token) or request.grammar.is_terminated():
            return FinishReason.STOP
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token in request.eos_token_ids:
            return FinishReason.STOP
        if token in params.stop_token_ids:
            return FinishReason.STOP
    if request.num_output_tokens >= request.max_tokens:
        return FinishReason.LENGTH
    return None
