"""M-RoPE positions of a step (Qwen2-VL; backend/models/qwen2_vl.py).

A token of a request with images rotates by its own (temporal, row, column)
positions: precomputed for the prompt at intake (MultiModalInputs.mrope_positions),
and after the prompt its index plus the request's `mrope_delta`, all three equal. So a
step whose tokens are all past their prompts needs only the 1-D positions shifted by
the delta (what decode and verify CUDA graphs read); a step with prompt tokens of such
a request also gets the [3, T] table, which the model reads instead."""

from __future__ import annotations

from typing import Optional

import numpy as np


def deltas(sched, states) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(delta, prompt length) per scheduled request, or None when none has images.
    `states`: the scheduled requests' states (request_state.py)."""
    if not any(state.mm_inputs is not None for state in states):
        return None
    delta = np.fromiter((state.mm_inputs.mrope_delta if state.mm_inputs is not None else 0
                         for state in states), dtype=np.int64, count=len(sched))
    prompt = np.fromiter((state.num_prompt_tokens for state in states), dtype=np.int64, count=len(sched))
    return delta, prompt


def shift(pos: np.ndarray, seq_of_token: np.ndarray, mrope: tuple[np.ndarray, np.ndarray]) -> None:
    """Tokens past their request's prompt: index + delta (in place)."""
    delta, prompt = mrope
    past = pos >= prompt[seq_of_token]
    pos += np.where(past, delta[seq_of_token], 0).astype(pos.dtype)


def table(sched, states, num_padded: int) -> Optional[np.ndarray]:
    """[3, num_padded] positions when a request with images has prompt tokens in the
    step, else None. Padding columns are 0."""
    if not any(s.in_image_prompt for s in sched):
        return None
    out = np.zeros((3, num_padded), dtype=np.int64)
    first = 0
    for s, r in zip(sched, states):
        a, n = s.num_computed_tokens, s.num_new_tokens
        idx = np.arange(a, a + n)
        mm = r.mm_inputs
        if mm is None:
            out[:, first:first + n] = idx
        else:
            p = min(a + n, r.num_prompt_tokens)
            k = max(0, p - a)
            out[:, first:first + k] = mm.mrope_positions[:, a:p]
            out[:, first + k:first + n] = idx[k:] + mm.mrope_delta
        first += n
    return out
