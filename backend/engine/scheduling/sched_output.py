"""What the scheduler hands the model runner for one step (vLLM's sched/output.py): each
scheduled request's share of the step, as the scheduler left it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch

from backend.engine.kv_offload.connector import KVTransfers
from backend.engine.request import Request
from backend.multimodal.inputs import ImageItem


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Proposed tokens verified in this step (the last len() of num_new_tokens), and the
    # draft's distributions they were drawn from, if any. A draft model's are on the
    # device (spec_decode/draft_tokens.py): the host holds how many.
    spec_token_ids: Sequence[int] = field(default_factory=list)
    draft_probs: Optional[torch.Tensor] = None
    # Set from the step's result: proposed tokens the target rejected.
    num_rejected: int = 0
    # Slots reserved past this step's tokens for what the draft model writes ahead inside
    # the runner's step (vLLM's num_lookahead_tokens): the newest token's K/V and
    # proposals 1..k-1; 0 when this request proposes nothing after the step.
    num_lookahead_tokens: int = 0
    # As scheduled: where this step's tokens start, and whether after it every token of
    # the request (a placeholder of a step in flight included) has its K/V, so that the
    # logits of the last one give the next token.
    num_computed_tokens: int = field(init=False)
    completes_prompt: bool = field(init=False)
    # Prompt logprobs: the positions start:start+n of this step's tokens whose logits give
    # them (each predicts the prompt token after it), set by the scheduler.
    prompt_logprob_start: int = 0
    num_prompt_logprob_rows: int = 0

    @property
    def in_image_prompt(self) -> bool:
        """The step holds prompt tokens of a request with images: what needs the image
        rows, M-RoPE's table or key limits (runner/mm_step.py, mrope.py, image_attention.py)."""
        return self.request.mm_inputs is not None and self.num_computed_tokens < self.request.num_prompt_tokens

    def rejected_among(self, new_tokens: list[int]) -> int:
        """How many of this step's proposals the target rejected, given the request's new
        tokens from the step (the accepted proposals and the target's next one)."""
        return len(self.spec_token_ids) + 1 - len(new_tokens) if self.spec_token_ids and new_tokens else 0

    def __post_init__(self) -> None:
        r = self.request
        self.num_computed_tokens = r.num_computed_tokens
        self.completes_prompt = (r.num_computed_tokens + self.num_new_tokens
                                 >= r.num_tokens + r.num_output_placeholders)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Copies between the KV pool and a store beyond it (kv_offload/), run before the forward.
    kv_transfers: Optional[KVTransfers] = None
    # Vision-language models (scheduling/encoder_cache.py): the images the vision tower
    # runs before this step's forward, and the outputs (by hash) the runner drops first.
    encoder_inputs: list[ImageItem] = field(default_factory=list)
    encoder_frees: list[bytes] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def image_chunks(scheduled: Sequence[ScheduledRequest]) -> Iterator[tuple[int, ImageItem, int, int]]:
    """Each image token range the step computes, in order: (where the range starts among
    the step's packed tokens, the image, its first and end positions in the request)."""
    first = 0
    for s in scheduled:
        a, n = s.num_computed_tokens, s.num_new_tokens
        if s.in_image_prompt:
            for i in s.request.mm_inputs.overlapping(a, a + n):
                item = s.request.mm_inputs.items[i]
                lo, hi = max(a, item.offset), min(a + n, item.end)
                yield first + lo - a, item, lo, hi
        first += n
