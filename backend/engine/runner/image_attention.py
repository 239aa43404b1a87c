"""Key limits of a step whose images attend to themselves in both directions (Gemma 3):
each token may attend to keys 0..limit-1 of its sequence, where the limit is its
position + 1, or for a token of an image the image's end (the whole image). The
scheduler keeps an image's remaining tokens in one chunk (encoder_cache.py), so every
key below a limit is in the cache or in the step. None for a step without image tokens
(causal as always: decode steps and their CUDA graphs never carry limits)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from backend.engine.scheduling.sched_output import image_chunks


def key_limits(sched, num_padded: int) -> Optional[np.ndarray]:
    if not any(s.in_image_prompt for s in sched):
        return None                                   # (most steps: no per-token work)
    limits = np.zeros(num_padded, dtype=np.int32)     # (padding rows attend to nothing)
    first = 0
    for s in sched:
        a, n = s.num_computed_tokens, s.num_new_tokens
        limits[first:first + n] = np.arange(a + 1, a + n + 1)
        first += n
    images = False
    for start, item, lo, hi in image_chunks(sched):
        limits[start:start + hi - lo] = item.end
        images = True
    return limits if images else None
