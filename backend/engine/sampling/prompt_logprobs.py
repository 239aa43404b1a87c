"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's name and meaning): the log
probability of each prompt token given the tokens before it, its rank, and the k most
likely tokens at that position.

Computed in the batched step, chunk by chunk: a scheduled prompt chunk of a request that
asks adds rows to the step's logits (the positions the scheduler assigned it,
ScheduledRequest.prompt_logprob_start/num_prompt_logprob_rows; StepInputBuilder puts
them after the sampled rows), and here, on the device, one log-softmax over those rows
(fp32, from the raw logits as vLLM does), a gather of the next prompt token, a count for
its rank and one top-k at the step's largest k. The result joins the step's one
device-to-host copy (model_runner.py); the targets (the next prompt tokens) go up in
one host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.sampling.logprobs import TokenLogprobs, pack_rows, unpack_row


@dataclass
class PromptLogprobPlan:
    """One step's prompt-logprob rows: per scheduled request that has some (by schedule
    index), how many rows and its k; the rows' target ids on the device."""
    index: list[int]            # schedule index of each listed request
    counts: list[int]           # its number of rows
    ks: list[int]               # its prompt_logprobs
    targets: torch.Tensor       # int64 [N]: the prompt token each row predicts
    target_ids: list[int]       # the same, on the host
    max_k: int

    @property
    def num_rows(self) -> int:
        return len(self.target_ids)

    @property
    def packed_len(self) -> int:
        return self.num_rows * (2 + 2 * self.max_k)


class PromptLogprobPlanner:
    def __init__(self, device: torch.device) -> None:
        self._targets = GrowingStagedBuffer(torch.int64, device)

    def plan(self, scheduled, states, vocab_size: int) -> Optional[PromptLogprobPlan]:
        """The rows of a scheduled step (ScheduledRequests and their RequestStates, in
        order), or None without any."""
        index, counts, ks, targets = [], [], [], []
        for i, (s, state) in enumerate(zip(scheduled, states)):
            n = s.num_prompt_logprob_rows
            if not n:
                continue
            start = s.prompt_logprob_start
            index.append(i)
            counts.append(n)
            ks.append(min(state.sampling_params.prompt_logprobs, vocab_size))
            targets += state.prompt_token_ids[start + 1:start + 1 + n]
        if not index:
            return None
        return PromptLogprobPlan(index, counts, ks, self._targets.upload(np.asarray(targets, dtype=np.int64)),
                                 targets, max(ks))


def pack(logits: torch.Tensor, plan: PromptLogprobPlan) -> torch.Tensor:
    """logits: [N, V], the plan's rows in order -> per row: the target's logprob, its
    rank, the top max_k logprobs, their ids (logprobs.pack_rows)."""
    return pack_rows(logits, plan.targets, plan.max_k)


def unpack(values: list[float], plan: PromptLogprobPlan) -> dict[int, list[TokenLogprobs]]:
    """The host copy of `pack` -> {schedule index: one entry per row}: the prompt token
    first, then the request's k most likely (vLLM's order)."""
    width = 2 + 2 * plan.max_k
    out: dict[int, list[TokenLogprobs]] = {}
    row = 0
    for i, n, k in zip(plan.index, plan.counts, plan.ks):
        out[i] = [unpack_row(values, (row + j) * width, plan.target_ids[row + j], k, plan.max_k) for j in range(n)]
        row += n
    return out
