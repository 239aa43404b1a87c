"""logit_bias (OpenAI's): a value added to chosen tokens' logits, before everything else
(as vLLM applies it). Ids outside the vocabulary are left out at intake (SamplingRow)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.sampling.logits_processors.base import TokenLogitsProcessor


class LogitBias(TokenLogitsProcessor):
    name = "logit_bias"

    def __init__(self, device: torch.device, max_num_seqs: int, staging_slots: int) -> None:
        super().__init__(device, max_num_seqs, staging_slots)
        self._values = GrowingStagedBuffer(torch.float32, device, slots=staging_slots)

    @classmethod
    def is_on(cls, row, params) -> bool:
        return bool(row.bias_ids)

    def begin(self, vocab_size: int, num_rows: int) -> None:
        self.rows: list[int] = []
        self.ids: list[int] = []
        self.values: list[float] = []

    def add_row(self, i: int, state, row) -> None:
        self.rows.extend([i] * len(row.bias_ids))
        self.ids.extend(row.bias_ids)
        self.values += row.bias_values

    def host_parts(self) -> list[list[int]]:
        return [self.rows, self.ids]

    def take(self, views: list[Optional[torch.Tensor]]) -> Optional[tuple]:
        if not self.rows:
            return None
        return views[0], views[1], self._values.upload(np.asarray(self.values, dtype=np.float32))

    def apply(self, logits: torch.Tensor, data: tuple, params: torch.Tensor) -> torch.Tensor:
        rows, ids, values = data
        return logits.index_put_((rows, ids), values, accumulate=True)
