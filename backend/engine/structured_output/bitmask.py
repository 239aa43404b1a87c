"""The runner's share of structured output: a step's grammar bitmask, made by the
scheduler (Scheduler.grammar_bitmask, from each guided request's matcher), applied to
the logits before the draw. xgrammar is imported only when a step has guided rows."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, mask: tuple[torch.Tensor, list[int]], vocab_size: int) -> None:
    """Disallowed tokens of the guided rows to -inf, in place. `mask`: (device bitmask
    [R, vocab / 32], the rows it applies to)."""
    import xgrammar as xgr
    bitmask, rows = mask
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=rows)
