"""Rotary position embedding tables, computed as Hugging Face does so that fp32 results
match bit for bit: fp32 angles from positions × inverse frequencies. Applying them
(cos/sin cast to the activation dtype, rotate-half layout) is LayerOps.rotary's job.

LongRoPE (Phi-3) has two sets of frequencies. transformers picks the long set for a
forward whose last position is past original_max_position_embeddings, so a prompt
longer than that is encoded with the long set throughout, and a shorter one with the
short set until the sequence reaches original + 1 tokens, when its generate drops the
KV cache and recomputes the whole sequence with the long set (Phi3ForCausalLM.
prepare_inputs_for_generation). The engine does the same: Request.long_rope is set at
intake for a long prompt, or by the scheduler, which restarts a request (frees its KV,
recomputes it) at the step that would compute position `original`. The table here is
[short rows for 0..max-1 ; long rows for 0..max-1] and the step's positions for the model
carry `+ max_position` for the tokens of long requests (backend/engine/runner/step_inputs.py);
their prefix-cache chain has its own salt (`long_rope_salt`)."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Optional

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "yarn":
        return yarn_frequencies(head_dim, theta, scaling)
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def yarn_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (gpt-oss, DeepSeek, Qwen long context): frequencies that turn fewer than
    beta_slow times over the original context are interpolated (divided by factor),
    those turning more than beta_fast times kept, a linear ramp between; as transformers'
    _compute_yarn_parameters computes it (attention_factor scales cos/sin, below)."""
    base, factor, original = theta, scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001       # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def longrope_frequencies(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** shape)


def long_rope(scaling: Optional[dict[str, Any]]) -> Optional[int]:
    """original_max_position_embeddings of a LongRoPE model, else None."""
    if scaling is None or scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


def long_rope_salt(salt: Optional[bytes]) -> bytes:
    """The prefix-cache salt of a request whose tokens take LongRoPE's long frequencies:
    its KV must never be shared with a request encoded with the short ones over the same
    tokens (and the reverse)."""
    return hashlib.sha256(b"longrope\0" + (salt or b"")).digest()


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict[str, Any]]) -> None:
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float32)
        if long_rope(scaling) is None:
            sets = [inverse_frequencies(head_dim, theta, scaling)]
        else:
            sets = [longrope_frequencies(head_dim, theta, scaling[k]) for k in ("short_factor", "long_factor")]
        cos, sin = [], []
        for inv_freq in sets:
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos.append(emb.cos())
            sin.append(emb.sin())
        cos_cache, sin_cache = torch.cat(cos), torch.cat(sin)
        if scaling is not None and "attention_factor" in scaling:
            # transformers scales cos and sin (LongRoPE's attention scaling), in fp32.
            cos_cache, sin_cache = cos_cache * scaling["attention_factor"], sin_cache * scaling["attention_factor"]
        self.register_buffer("cos_cache", cos_cache, persistent=False)
        self.register_buffer("sin_cache", sin_cache, persistent=False)
