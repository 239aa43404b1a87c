"""Dynamo's token-level protocol, in and out of our engine's types.

Dynamo's frontend applies the chat template, tokenizes, detokenizes and matches stop
strings itself. It sends a worker a PreprocessedRequest (`token_ids`, `sampling_options`,
`stop_conditions`, `output_options`) and reads back chunks of new `token_ids`, a
`finish_reason` on the last, and `completion_usage`: the same contract Dynamo's vLLM and
SGLang workers serve. Pure functions, so they are tested without Dynamo installed.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError

from backend.engine.outputs import RequestOutput
from backend.sampling_params import SamplingParams

# sampling_options keys that are our SamplingParams fields under the same name.
_SAMPLING_KEYS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "include_stop_str_in_output")
_GUIDED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                "grammar": "guided_grammar"}


class BadRequest(ValueError):
    """A request this worker cannot serve; its message names the field."""


def sampling_params_from(request: dict[str, Any], max_model_len: int) -> SamplingParams:
    """The engine's SamplingParams for one PreprocessedRequest."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids:
        raise BadRequest("token_ids: a non-empty list of token ids is required")
    options = request.get("sampling_options") or {}
    stop = request.get("stop_conditions") or {}
    output = request.get("output_options") or {}
    fields: dict[str, Any] = {k: options[k] for k in _SAMPLING_KEYS if options.get(k) is not None}
    guided = options.get("guided_decoding") or {}
    fields.update({ours: guided[theirs] for theirs, ours in _GUIDED_KEYS.items()
                   if guided.get(theirs) is not None})
    max_tokens = stop.get("max_tokens")
    # As vLLM: without max_tokens a request may run to the end of the context.
    fields["max_tokens"] = max_tokens if max_tokens is not None else max(1, max_model_len - len(token_ids))
    if stop.get("min_tokens") is not None:
        fields["min_tokens"] = stop["min_tokens"]
    if stop.get("ignore_eos") is not None:
        fields["ignore_eos"] = stop["ignore_eos"]
    # Dynamo matches stop strings on its side; the ids it hides from the output (the
    # model's EOS ids among them) must end the request here.
    stop_ids = list(stop.get("stop_token_ids_hidden") or []) + list(stop.get("stop_token_ids") or [])
    if stop_ids:
        fields["stop_token_ids"] = sorted(set(stop_ids))
    if output.get("logprobs") is not None:
        fields["logprobs"] = output["logprobs"]
    if output.get("prompt_logprobs") is not None:
        fields["prompt_logprobs"] = output["prompt_logprobs"]
    priority = (request.get("routing") or {}).get("priority")
    if priority is not None:
        fields["priority"] = priority
    try:
        return SamplingParams(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(map(str, first["loc"]))
        raise BadRequest(f"{where}: {first['msg']}" if where else first["msg"]) from None


def chunk_from(out: RequestOutput, num_output_tokens: int) -> Optional[dict[str, Any]]:
    """The response chunk for one engine output (None when it carries nothing)."""
    if not out.finished and not out.new_token_ids:
        return None
    chunk: dict[str, Any] = {"index": 0, "token_ids": list(out.new_token_ids)}
    if out.new_logprobs:
        # Per token: the sampled token's logprob, then every listed token's (the sampled
        # one first, as our TokenLogprobs keeps them); Dynamo adds the text.
        chunk["log_probs"] = [entry[token_id].logprob
                              for token_id, entry in zip(out.new_token_ids, out.new_logprobs)]
        chunk["top_logprobs"] = [
            [{"rank": lp.rank, "token_id": token_id, "token": lp.decoded_token, "logprob": lp.logprob}
             for token_id, lp in entry.items()]
            for entry in out.new_logprobs]
    if out.finished:
        if out.finish_reason == "error" or out.error is not None:
            # Dynamo's convention (its vLLM worker's too): the frontend turns this into an error.
            chunk["finish_reason"] = f"error: {out.error or 'the request failed'}"
        else:
            chunk["finish_reason"] = "cancelled" if out.finish_reason == "abort" else out.finish_reason
        chunk["completion_usage"] = usage_of(out, num_output_tokens)
    return chunk


def usage_of(out: RequestOutput, num_output_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": out.num_prompt_tokens + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}
