"""What the scheduler hands the model runner for one step (vLLM's sched/output.py): a
typed step. The runner reads only these fields, never the scheduler's `Request`
objects (tests/unit/engine/test_runner_reads_typed_steps.py checks it):

- `new_requests`: each request the step admits, with everything the runner keeps of it
  (runner/request_state.py), sent once per admission (again, marked resumed, after a
  preemption);
- `scheduled`: each scheduled request's share of the step (ScheduledRequest: its
  tokens, proposals and prompt-logprob rows, and what changed in its block table since
  the runner last got it, all as numbers and ids);
- `finished_req_ids` and `preempted_req_ids`: what the runner drops or pauses;
- `other_block_diffs`: tables of requests outside the step that changed (trimmed while
  their step was in flight).

Output tokens travel the other way: the runner samples them and keeps its own copy.
`ScheduledRequest.request` and `preempted` are the scheduler's own bookkeeping, for
applying the step's result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from backend.engine.kv_offload.connector import KVTransfers
from backend.engine.request import Request
from backend.engine.spec_decode.draft_tokens import DraftTokens
from backend.multimodal.inputs import ImageItem
from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.engine.sampling.bad_words import BadWords
    from backend.engine.sampling.sampling_row import SamplingRow
    from backend.multimodal.inputs import MultiModalInputs


@dataclass(frozen=True)
class NewRequestData:
    """A request as the runner first gets it (vLLM's NewRequestData): what stays fixed
    for its life, the tokens it has, and where its first step starts."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]         # (a copy: non-empty when resumed, or imported with tokens)
    sampling_params: SamplingParams
    max_tokens: int                     # the effective limit (max_model_len taken into account)
    eos_token_ids: frozenset[int]
    sampling_row: Optional["SamplingRow"]
    bad_words: Optional["BadWords"]
    mm_inputs: Optional["MultiModalInputs"]
    long_rope: bool
    pooling: bool
    # Tokens whose K/V the admission found computed (prefix-cache hits): the draft
    # model's K/V lives in the same blocks, so it has them too.
    num_computed_tokens: int
    # Admitted again after a preemption (or a LongRoPE restart): the runner keeps what it
    # had (its tokens, its seeded generator) and takes the new long_rope and start.
    resumed: bool = False

    def for_ranks(self) -> "NewRequestData":
        """What a rank that never samples keeps (backend/parallel/rank.py): the tokens and
        where they start, without the sampling settings, words or images. (A resumed
        request's tokens go again, though the rank kept its own: rank 0's runner makes a
        state from them where it kept none.)"""
        return dataclasses.replace(self, sampling_params=None, sampling_row=None, bad_words=None, mm_inputs=None)

    @classmethod
    def of(cls, request: Request, resumed: bool = False) -> "NewRequestData":
        return cls(request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                   request.sampling_params, request.max_tokens, request.eos_token_ids, request.sampling_row,
                   request.bad_words, request.mm_inputs, request.long_rope, request.pooling,
                   request.num_computed_tokens, resumed)


@dataclass
class ScheduledRequest:
    # The scheduler's own request (for applying the result; the runner never reads it).
    request: Optional[Request]
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
    # As scheduled (taken from `request` when one is given): which request, where this
    # step's tokens start, whether after it every token of the request (a placeholder of
    # a step in flight included) has its K/V, so that the logits of the last one give the
    # next token, and whether the step holds prompt tokens of a request with images (what
    # needs the image rows, M-RoPE's table or key limits: runner/mm_step.py, mrope.py,
    # image_attention.py).
    request_id: str = ""
    num_computed_tokens: int = 0
    completes_prompt: bool = True
    in_image_prompt: bool = False
    # Prompt logprobs: the positions start:start+n of this step's tokens whose logits give
    # them (each predicts the prompt token after it), set by the scheduler.
    prompt_logprob_start: int = 0
    num_prompt_logprob_rows: int = 0
    # The request's block table from entry block_ids_start on, as this step has it, or
    # None where it did not change (vLLM's new_block_ids; ours can also replace trailing
    # entries, given back after rejected proposals): the runner's copy is kept by these
    # diffs alone (backend/engine/block_table.py). Set once the step's allocations are
    # made (KVCacheManager.set_block_diffs).
    block_ids_start: int = 0
    new_block_ids: Optional[list[int]] = None

    def rejected_among(self, new_tokens: list[int]) -> int:
        """How many of this step's proposals the target rejected, given the request's new
        tokens from the step (the accepted proposals and the target's next one)."""
        return len(self.spec_token_ids) + 1 - len(new_tokens) if self.spec_token_ids and new_tokens else 0

    def __post_init__(self) -> None:
        r = self.request
        if r is None:
            return
        self.request_id = r.request_id
        self.num_computed_tokens = r.num_computed_tokens
        self.completes_prompt = (r.num_computed_tokens + self.num_new_tokens
                                 >= r.num_tokens + r.num_output_placeholders)
        self.in_image_prompt = r.mm_inputs is not None and r.num_computed_tokens < r.num_prompt_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests that finished (or were aborted) since the last step the runner got, and
    # those this step preempted (the scheduler's own list of them: `preempted`).
    finished_req_ids: list[str] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Block-table diffs (ScheduledRequest.block_ids_start, new_block_ids) of requests not
    # in this step whose tables changed since their last one, by id.
    other_block_diffs: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    # Copies between the KV pool and a store beyond it (kv_offload/), run before the forward.
    kv_transfers: Optional[KVTransfers] = None
    # Vision-language models (scheduling/encoder_cache.py): the images the vision tower
    # runs before this step's forward, and the outputs (by hash) the runner drops first.
    encoder_inputs: list[ImageItem] = field(default_factory=list)
    encoder_frees: list[bytes] = field(default_factory=list)

    @classmethod
    def first_step(cls, scheduled: list[ScheduledRequest], **kwargs) -> "SchedulerOutput":
        """A step whose requests the runner has not seen (tests and benchmarks that build
        steps by hand)."""
        return cls(scheduled, [NewRequestData.of(s.request) for s in scheduled], **kwargs)

    @property
    def changes_nothing(self) -> bool:
        """An empty step that leaves the runner's states as they are."""
        return not (self.scheduled or self.new_requests or self.finished_req_ids or self.preempted_req_ids
                    or self.other_block_diffs)

    def for_ranks(self) -> "RankStepData":
        """The step as the other tensor- and pipeline-parallel ranks get it (in the
        control group's message: backend/parallel/step_payload.py): numbers, ids and
        tokens only, none of the scheduler's own objects or device tensors. Each rank
        keeps request states of its own from these and builds its own step inputs."""
        if any(isinstance(s.spec_token_ids, DraftTokens) for s in self.scheduled):
            raise ValueError("proposals on the device (a draft model's) cannot reach the other ranks")
        return RankStepData(list(map(_rank_fields, self.scheduled)), [new.for_ranks() for new in self.new_requests],
                            list(self.finished_req_ids), list(self.preempted_req_ids), dict(self.other_block_diffs))

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# What a rank reads of each ScheduledRequest, sent as one tuple per request: a row of
# plain values costs far less to make and pickle than a copy of the object (256 rows: a
# tenth of a millisecond against one and a half).
_RANK_FIELDS = ("num_new_tokens", "spec_token_ids", "num_lookahead_tokens", "request_id", "num_computed_tokens",
                "completes_prompt", "in_image_prompt", "prompt_logprob_start", "num_prompt_logprob_rows",
                "block_ids_start", "new_block_ids")
_rank_fields = attrgetter(*_RANK_FIELDS)


@dataclass
class RankStepData:
    """A typed step as the other ranks get it (SchedulerOutput.for_ranks), expanded
    there by `step()`."""
    scheduled: list[tuple]                  # per scheduled request: its _RANK_FIELDS
    new_requests: list[NewRequestData]      # (NewRequestData.for_ranks)
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    other_block_diffs: dict[str, tuple[int, list[int]]]

    def step(self) -> SchedulerOutput:
        return SchedulerOutput([ScheduledRequest(None, **dict(zip(_RANK_FIELDS, row))) for row in self.scheduled],
                               self.new_requests, self.finished_req_ids, self.preempted_req_ids,
                               other_block_diffs=self.other_block_diffs)
