"""What the engine hands back after each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from backend.engine.sampling.logprobs import TokenLogprobs

if TYPE_CHECKING:
    from backend.engine.spec_decode.proposals import Proposals


@dataclass
class ModelRunnerOutput:
    """A step's result from the model runner, per scheduled request in schedule order:
    the new token ids (none for a request whose prompt chunk did not reach its end; one;
    or, verifying proposals, the accepted ones and the target's next), and the logprobs
    of the requests that asked, by index in the schedule."""
    sampled_token_ids: list[list[int]]
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    # Prompt logprobs computed in this step, by index in the schedule: one entry per
    # prompt token the step's rows predict (the ScheduledRequest's prompt_logprob_rows).
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    # runner="pooling": the pooled vector ([hidden], fp32, on the host) of each request
    # whose prompt this step completed, by index in the schedule.
    pooler_output: dict[int, torch.Tensor] = field(default_factory=dict)
    # A draft model's proposals for the next step, made inside this step by the runner
    # (spec_decode/draft_model.py), which the scheduler applies with the tokens.
    proposals: Optional["Proposals"] = None


@dataclass
class EngineCoreOutput:
    """One request's progress in one step as the scheduler leaves it: token ids only, no
    text. The output side (output_processor.py) turns it into a RequestOutput."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[TokenLogprobs]] = None
    # Prompt logprobs of the next prompt positions, in order (a prompt chunk may bring
    # some with no new token).
    new_prompt_logprobs: Optional[list[TokenLogprobs]] = None
    # Set when the scheduler ended the request: "stop" (EOS, stop id, grammar), "length",
    # "abort"; with an error when it ended on one.
    finish_reason: Optional[str] = None
    num_cached_tokens: int = 0
    error: Optional[Exception] = None
    # A pooling request's result (it finishes with "stop" when its prompt is computed).
    pooling_output: Optional[torch.Tensor] = None
    # Prefill/decode disaggregation: the blocks kept for a decode engine (kv_handoff.py).
    kv_transfer_params: Optional[dict] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's progress in one step.

    `new_token_ids` and `new_text` are the deltas since the previous output of the same
    request (what a stream sends). `token_ids` and `text` are cumulative and are filled
    in on the final output.
    """
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: Optional[str] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # With SamplingParams.logprobs: one entry per token of new_token_ids, the running sum
    # of the generated tokens' logprobs, and (on the final output) every token's entry.
    new_logprobs: Optional[list[TokenLogprobs]] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[TokenLogprobs]] = None
    # With SamplingParams.prompt_logprobs (vLLM's RequestOutput.prompt_logprobs): one
    # entry per prompt token, None for the first (nothing predicts it). Set on the first
    # output with a generated token and on the final output; None on the others.
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None
    # Set when the request ended on an error rather than normally (finished is True).
    error: Optional[Exception] = None
    # runner="pooling": the prompt's pooled (and by default L2-normalized) final hidden
    # state, fp32 on the host, on the final output (vLLM's PoolingOutput.data).
    pooling_output: Optional[torch.Tensor] = None
    # vLLM's RequestOutput.kv_transfer_params: on the final output of a request that kept
    # its blocks for a decode engine (SamplingParams.kv_transfer_params), where they are.
    kv_transfer_params: Optional[dict] = None
    # Offline `LLM.generate` with n > 1: the n completions' final outputs, in index order
    # (this output is the first one's, under the parent's request id).
    completions: Optional[list["RequestOutput"]] = None
