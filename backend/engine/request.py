"""State of one request as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from backend.engine.token_sequence import TokenSequence
from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.multimodal.inputs import MultiModalInputs
    from backend.engine.sampling.bad_words import BadWords
    from backend.engine.sampling.sampling_row import SamplingRow


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"     # in the waiting queue, not admitted yet
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token id or a stop string
    LENGTH = "length"    # max_tokens or max_model_len
    ABORT = "abort"      # cancelled by the caller


@dataclass
class Request(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    # Effective limit on generated tokens after max_model_len is taken into account.
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    # Tokens whose K/V are in the cache, or are being computed by a scheduled step (the
    # scheduler advances it when it schedules them; rejected proposals roll it back).
    # Reset to 0 on preemption (recompute).
    num_computed_tokens: int = 0
    # Tokens sampled by scheduled steps whose results have not arrived (async
    # scheduling: at most one; the next step's input for it comes from the device).
    num_output_placeholders: int = 0
    # Prompt tokens served from the prefix cache on the latest admission.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # The sampling settings as the sampler reads them each step, worked out at intake
    # (backend/engine/sampling/sampling_row.py); None: the sampler works them out itself.
    sampling_row: Optional["SamplingRow"] = None
    # The request's bad words as token sequences (backend/engine/sampling/bad_words.py), resolved
    # once at intake; None: none.
    bad_words: Optional["BadWords"] = None
    # Structured output: the xgrammar matcher of this request's grammar, or None.
    grammar: Optional[object] = None
    # With `reasoning_end_token_ids`, the grammar applies only once the output holds them
    # (the scheduler sets this when they arrive); until then the reply reasons freely.
    reasoning_ended: bool = True
    # Hashes of this request's full blocks, chained; extended as tokens are added.
    block_hashes: list[int] = field(default_factory=list)
    # The chain's root (its first block's parent): set for a LoRA adapter, so that blocks
    # computed under one adapter are never reused under another or the base model.
    cache_salt: Optional[bytes] = None
    # Prefill/decode disaggregation: set when it finished with its blocks kept for a
    # decode engine (kv_handoff.py): which blocks, and the tokens they hold.
    kv_transfer_params: Optional[dict] = None
    # LongRoPE models (backend/models/rotary.py): every token of this request takes the
    # long frequencies (its length passed the original context: at intake, or when the
    # scheduler restarted it on crossing).
    long_rope: bool = False
    # Speculative decoding (backend/engine/spec_decode/): tokens proposed for the next
    # step to verify (a draft model's stay on the device: spec_decode/draft_tokens.py),
    # and with a draft model on a sampled request the draft's distribution each was
    # drawn from ([len(spec_token_ids), V] on the device).
    spec_token_ids: Sequence[int] = field(default_factory=list)
    draft_probs: Optional[torch.Tensor] = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): the logits at positions
    # 0:num_prompt_logprob_rows have been scheduled for them. Never reset: after a
    # preemption the recompute skips them, so no position is reported twice.
    num_prompt_logprob_rows: int = 0

    @property
    def prompt_logprob_rows_end(self) -> int:
        """Positions whose logits give prompt logprobs: 0..P-2 (the logits at P-1 give the
        first generated token); 0 when the request asks for none."""
        if self.sampling_params.prompt_logprobs is None:
            return 0
        return len(self.prompt_token_ids) - 1

    # Vision-language models: the prompt's images (their placeholder tokens are in
    # prompt_token_ids) and M-RoPE positions; None for a text-only request.
    mm_inputs: Optional["MultiModalInputs"] = None

    def block_key(self, i: int, block_size: int) -> tuple[int, ...]:
        """What identifies full block i in the prefix cache: its token ids, and for a
        prompt with images, the hash and place of each image its tokens are part of."""
        a, b = i * block_size, (i + 1) * block_size
        tokens = tuple(self.token_slice(a, b))
        if self.mm_inputs is None or a >= len(self.prompt_token_ids):
            return tokens
        return tokens + self.mm_inputs.block_extras(a, b)

    # runner="pooling": prefill only; the step that completes the prompt returns its
    # pooled hidden state and the request finishes there, nothing sampled.
    pooling: bool = False

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
