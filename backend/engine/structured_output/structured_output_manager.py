"""Structured output, one owner: the scheduler's StructuredOutputManager.

A guided request enters the scheduler with status WAITING_FOR_GRAMMAR while its grammar
compiles off the step loop (structured_output.py: xgrammar on a worker thread, a time
limit, the compiler's message on failure); the scheduler leaves it in the waiting queue
and admits it once `update` has found its grammar ready, or ends it with the error. The
scheduler advances each request's matcher with its tokens (`Scheduler.update_from_output`)
and hands the runner each step's bitmask (`Scheduler.grammar_bitmask`).

xgrammar is imported when the first guided request arrives.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from backend.engine.structured_output.grammar import AwaitingGrammar, StructuredOutput


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, device: torch.device, max_num_seqs: int,
                 compile_timeout_s: float) -> None:
        self._args = (tokenizer, vocab_size, device, max_num_seqs)
        self.backend: Optional[StructuredOutput] = None
        self._awaiting = AwaitingGrammar(compile_timeout_s)

    @property
    def pool(self):
        """The compile pool (its abandoned compiles are what new guided requests wait on)."""
        return self.backend.pool if self.backend is not None else None

    def submit(self, request) -> None:
        """Starts compiling the request's grammar. Raises InvalidRequestError (no tokenizer,
        no xgrammar) or QueueFullError (too many compiles given up on still run)."""
        if self.backend is None:
            self.backend = StructuredOutput(*self._args)
        self._awaiting.add(request, self.backend.compile(request.sampling_params, tag=request))

    @property
    def num_compiling(self) -> int:
        return len(self._awaiting)

    def update(self, wait_s: float = 0.0) -> tuple[list, list]:
        """(requests whose grammar is ready, their matcher set; (request, error) for those
        whose grammar failed or ran past its time limit). Waits up to wait_s for a
        compile when none has finished."""
        if not len(self._awaiting):
            return [], []
        return self._awaiting.ready(self.backend, time.monotonic(), wait_s=wait_s)

    def cancel(self, request_id: str) -> None:
        """The request ended while its grammar compiled: the compile is given up on."""
        if request_id in self._awaiting:
            self._awaiting.pop(self.backend, request_id)

    @property
    def started(self) -> bool:
        """Whether any request has asked for a grammar yet."""
        return self.backend is not None

    def bitmask(self, num_rows: int, guided: Sequence[tuple[int, object]]) -> tuple[torch.Tensor, list[int]]:
        """The bitmask of a step's `num_rows` sampled rows, filled for the `guided` (row,
        request whose grammar applies) ones (bitmask.apply_bitmask applies it)."""
        return self.backend.bitmask(num_rows, guided)
