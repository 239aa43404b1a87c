"""Key limits of a step whose images attend to themselves in both directions (Gemma 3):
each token may attend to keys 0..limit-1 of its sequence, where the limit is its
position + 1, or for a token of an image the image's end (the whole image). The
scheduler keeps an image's remaining tokens in one chunk (encoder_cache.py), so every
key below a limit is in the cache or in the step. None for a step without image tokens
(causal as always: decode steps and their CUDA graphs never carry limits)."""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np

from backend.multimodal.inputs import ImageItem


def image_chunks(scheduled: Sequence, states: Sequence) -> Iterator[tuple[int, ImageItem, int, int]]:
    """Each image token range the step computes, in order: (where the range starts among
    the step's packed tokens, the image, its first and end positions in the request).
    `states`: the scheduled requests' states (request_state.py)."""
    first = 0
    for s, state in zip(scheduled, states):
        a, n = s.num_computed_tokens, s.num_new_tokens
        if s.in_image_prompt:
            for i in state.mm_inputs.overlapping(a, a + n):
                item = state.mm_inputs.items[i]
                lo, hi = max(a, item.offset), min(a + n, item.end)
                yield first + lo - a, item, lo, hi
        first += n


def key_limits(sched, states, num_padded: int) -> Optional[np.ndarray]:
    if not any(s.in_image_prompt for s in sched):
        return None                                   # (most steps: no per-token work)
    limits = np.zeros(num_padded, dtype=np.int32)     # (padding rows attend to nothing)
    first = 0
    for s in sched:
        a, n = s.num_computed_tokens, s.num_new_tokens
        limits[first:first + n] = np.arange(a + 1, a + n + 1)
        first += n
    images = False
    for start, item, lo, hi in image_chunks(sched, states):
        limits[start:start + hi - lo] = item.end
        images = True
    return limits if images else None
