"""What every attention backend receives for one step: the packed-token layout used by
vLLM and TensorRT-LLM's in-flight batching.

Tokens of all scheduled requests are flattened; request i owns query rows
query_start_loc[i]:query_start_loc[i+1] and, after this step's K/V are written, has
seq_lens[i] tokens in the cache, reachable through block_tables[i].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch

# A layer's K (or V) cache scale: one value (FP8, per layer) or one per KV head (INT8).
Scale = Union[float, Sequence[float]]


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor   # int32 [B + 1]
    seq_lens: torch.Tensor          # int32 [B]
    block_tables: torch.Tensor      # int32 [B, max_blocks], padded with 0
    slot_mapping: torch.Tensor      # int64 [T]; -1 marks padding rows that write nothing
    # Host copies, so the torch path can plan without device syncs.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Split-KV factor for the Triton kernel; None lets it choose from max_seq_len. A
    # captured CUDA graph fixes it, since its launch grid is baked in.
    num_splits: Optional[int] = None
    # Per query token, how many of its sequence's keys it may attend to (keys 0..limit-1),
    # when that is not its position + 1: the tokens of an image attend to the whole image
    # (Gemma 3; backend/engine/runner/image_attention.py). None: causal.
    key_limits: Optional[torch.Tensor] = None
    # A tree of proposals (backend/engine/spec_decode/token_tree.py): int64 [T, 2], per
    # query token the index in its sequence where its tree's nodes start (2**40 for a
    # token outside any tree) and which of those nodes it may see (bit j: node j; its
    # ancestors and itself). Keys before the start follow the causal rule. None: no tree.
    tree: Optional[torch.Tensor] = None
    # The torch path's decode groups by block size (torch_attention.decode_groups), planned
    # by the first layer of the step and read by the others.
    decode_plan: Optional[dict] = field(default=None, repr=False, compare=False)


@dataclass
class KVCacheLayer:
    """One layer's paged cache: [num_blocks, block_size, num_kv_heads, head_dim] each.

    With an FP8 cache the stored value is x / scale, so the true value is stored * scale;
    one scale per layer. An INT8 cache stores round(x / scale) clamped to [-127, 127]
    with one scale per KV head (k_scale, v_scale: [num_kv_heads] sequences).
    """
    key: torch.Tensor
    value: torch.Tensor
    k_scale: Scale = 1.0
    v_scale: Scale = 1.0
    _scales: Optional[tuple[tuple, torch.Tensor]] = field(default=None, repr=False, compare=False)

    def scale_tensor(self) -> torch.Tensor:
        """[k_scale, v_scale] as fp32 on the cache's device, for kernels that read the
        scales from memory (as the TensorRT plugin must): [2], or [2, num_kv_heads] for
        per-head scales (row 0 K, row 1 V). Made once, not per step."""
        key = (_floats(self.k_scale), _floats(self.v_scale))
        if self.is_int8:    # the INT8 kernels index the scales by KV head: one value is every head's
            key = tuple((k,) * self.key.shape[2] if isinstance(k, float) else k for k in key)
        if self._scales is None or self._scales[0] != key:
            self._scales = (key, torch.tensor(key, dtype=torch.float32, device=self.key.device))
        return self._scales[1]

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def is_fp8(self) -> bool:
        return self.key.dtype == torch.float8_e4m3fn

    @property
    def is_int8(self) -> bool:
        return self.key.dtype == torch.int8


def _floats(scale: Scale):
    if isinstance(scale, torch.Tensor):
        scale = scale.tolist()
    return float(scale) if isinstance(scale, (int, float)) else tuple(float(s) for s in scale)
