"""The runner's own record of each request it runs (vLLM's CachedRequestState): made from
the scheduler's NewRequestData when a request is admitted, changed only by the typed
step (scheduling/sched_output.py) and by the tokens the runner itself samples.

The runner never reads the scheduler's `Request`: its tokens here are the ones it
sampled (appended when a step is collected, before the scheduler applies them), so a
step samples with penalties, min_tokens and bad words that include the step before,
whatever order the engine applies results in. The scheduler may end a request inside
tokens the runner appended (a stop token among accepted proposals, max_tokens): it
finishes then, and its state is dropped with the next step's `finished_req_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch

from backend.engine.block_table import BlockTable
from backend.engine.token_sequence import TokenSequence
from backend.sampling_params import SamplingParams

if TYPE_CHECKING:
    from backend.engine.sampling.bad_words import BadWords
    from backend.engine.sampling.sampling_row import SamplingRow
    from backend.engine.scheduling.sched_output import NewRequestData, SchedulerOutput
    from backend.multimodal.inputs import MultiModalInputs


@dataclass(eq=False)
class RequestState(TokenSequence):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    sampling_row: Optional["SamplingRow"] = None
    bad_words: Optional["BadWords"] = None
    mm_inputs: Optional["MultiModalInputs"] = None
    long_rope: bool = False
    pooling: bool = False
    # A seeded request's generator, on the runner's device: made once, kept across
    # preemptions, so that a resumed request goes on drawing where it stopped.
    generator: Optional[torch.Generator] = None
    # Tokens whose K/V the draft model (or EAGLE head) has in the request's blocks.
    num_draft_computed: int = 0
    # The runner's copy of the request's block table, kept by the steps' diffs; empty
    # once the request gave its blocks back (finished, preempted).
    block_ids: BlockTable = field(default_factory=BlockTable)
    # False once finished, and from a preemption until the request is admitted again: a
    # step in flight from before leaves it alone (no proposals, no moved K/V).
    running: bool = True

    @classmethod
    def of(cls, new: "NewRequestData", device: torch.device) -> "RequestState":
        # (a rank that never samples gets no sampling params: NewRequestData.for_ranks)
        seed = new.sampling_params.seed if new.sampling_params is not None else None
        return cls(new.request_id, new.prompt_token_ids, new.sampling_params, new.max_tokens, new.eos_token_ids,
                   list(new.output_token_ids), new.sampling_row, new.bad_words, new.mm_inputs, new.long_rope,
                   new.pooling, torch.Generator(device=device).manual_seed(seed) if seed is not None else None,
                   new.num_computed_tokens)


class RequestStates:
    """Every request the runner holds, by id; applied from each step before it is built.

    With `journal`, each change is also logged, in order, for ranks that keep copies of
    their own (tensor and pipeline parallel: backend/parallel/rank.py): every typed step
    applied (as `SchedulerOutput.for_ranks` gives it: RankStepData) and the sampled
    tokens appended to states still held. A rank that replays the log (`replay`) holds the same states, so
    it builds the same step inputs."""

    def __init__(self, device: torch.device, journal: bool = False) -> None:
        self.device = device
        self._states: dict[str, RequestState] = {}
        self._journal: Optional[list] = [] if journal else None

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def get(self, request_id: str) -> Optional[RequestState]:
        return self._states.get(request_id)

    def apply(self, out: "SchedulerOutput") -> list[RequestState]:
        """The step's changes (finished ids dropped, preempted ones paused, admitted ones
        made or resumed); the states of its scheduled requests, in order."""
        if self._journal is not None and not out.changes_nothing:
            self._journal.append(out.for_ranks())
        states = self._states
        for request_id in out.finished_req_ids:
            state = states.pop(request_id, None)
            if state is not None:
                state.running = False   # (a step in flight from before still holds it)
                state.block_ids.truncate(0)
        for request_id in out.preempted_req_ids:
            state = states.get(request_id)
            if state is not None:
                state.running, state.num_draft_computed = False, 0     # (its blocks are gone)
                state.block_ids.truncate(0)
        for new in out.new_requests:
            state = states.get(new.request_id) if new.resumed else None
            if state is None:
                states[new.request_id] = RequestState.of(new, self.device)
            else:
                state.running, state.long_rope, state.num_draft_computed = True, new.long_rope, new.num_computed_tokens
        try:
            scheduled = [states[s.request_id] for s in out.scheduled]
        except KeyError as e:
            raise RuntimeError(f"request {e} was scheduled but never sent to the runner "
                               "(SchedulerOutput.new_requests)") from None
        for s, state in zip(out.scheduled, scheduled):
            if s.new_block_ids is not None:     # (most decode steps: None)
                state.block_ids.apply_diff(s.block_ids_start, s.new_block_ids)
        for request_id, (start, block_ids) in out.other_block_diffs.items():
            state = states.get(request_id)
            if state is not None:
                state.block_ids.apply_diff(start, block_ids)
        return scheduled

    def append(self, states: Sequence[RequestState], sampled_token_ids: Sequence[list[int]]) -> None:
        """A collected step's new tokens, each to the state it was sampled for."""
        for state, tokens in zip(states, sampled_token_ids):
            if tokens:
                state.output_token_ids.extend(tokens)
        if self._journal is not None:
            # (only states still held: a finished request's id may come back as another's)
            appended = [(state.request_id, tokens) for state, tokens in zip(states, sampled_token_ids)
                        if tokens and self._states.get(state.request_id) is state]
            if appended:
                self._journal.append(appended)

    def take_journal(self) -> list:
        """The changes logged since the last call, oldest first (the journal empties)."""
        journal = self._journal
        if journal is None:
            return []
        self._journal = []
        return journal

    def replay(self, journal: list) -> tuple["SchedulerOutput", list[RequestState]]:
        """Another rank's journal (take_journal), whose last change is the step to build:
        that step, and the states of its scheduled requests."""
        if not journal or isinstance(journal[-1], list):
            raise RuntimeError("a rank's journal must end with the step it builds")
        scheduled: list[RequestState] = []
        for change in journal:
            if isinstance(change, list):
                for request_id, tokens in change:
                    self._states[request_id].output_token_ids.extend(tokens)
            else:
                step = change.step()
                scheduled = self.apply(step)
        return step, scheduled
