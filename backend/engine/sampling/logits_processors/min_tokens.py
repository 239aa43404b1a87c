"""min_tokens: while a request has generated fewer tokens, its stop ids and EOS (unless
ignore_eos) cannot be drawn (vLLM's MinTokensLogitsProcessor)."""

from __future__ import annotations

from typing import Optional

import torch

from backend.engine.sampling.logits_processors.base import TokenLogitsProcessor


class BannedTokens(TokenLogitsProcessor):
    """Token ids a row may not draw this step: their logits to -inf."""

    def begin(self, vocab_size: int, num_rows: int) -> None:
        self.rows: list[int] = []
        self.ids: list[int] = []

    def ban(self, i: int, ids) -> None:
        self.rows.extend([i] * len(ids))
        self.ids.extend(ids)

    def host_parts(self) -> list[list[int]]:
        return [self.rows, self.ids]

    def take(self, views: list[Optional[torch.Tensor]]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return (views[0], views[1]) if self.rows else None

    def apply(self, logits: torch.Tensor, data: tuple[torch.Tensor, torch.Tensor], params: torch.Tensor
              ) -> torch.Tensor:
        return logits.index_put_(data, torch.full((), float("-inf"), device=logits.device))


class MinTokens(BannedTokens):
    name = "min_tokens"

    @classmethod
    def is_on(cls, row, params) -> bool:
        return row.min_tokens > 0

    def add_row(self, i: int, state, row) -> None:
        if state.num_output_tokens < row.min_tokens:
            self.ban(i, row.min_tokens_banned)
