"""What every attention backend receives for one step: the packed-token layout used by
vLLM and TensorRT-LLM's in-flight batching.

Tokens of all scheduled requests are flattened; request i owns query rows
query_start_loc[i]:query_start_loc[i+1] and, after this step's K/V are written, has
seq_lens[i] tokens in the cache, reachable through block_tables[i].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


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


@dataclass
class KVCacheLayer:
    """One layer's paged cache: [num_blocks, block_size, num_kv_heads, head_dim] each.

    With an FP8 cache the stored value is x / scale, so the true value is stored * scale.
    """
    key: torch.Tensor
    value: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0
    _scales: Optional[tuple[tuple[float, float], torch.Tensor]] = field(default=None, repr=False, compare=False)

    def scale_tensor(self) -> torch.Tensor:
        """[k_scale, v_scale] as fp32 on the cache's device, for kernels that read the
        scales from memory (as the TensorRT plugin must). Made once, not per step."""
        key = (float(self.k_scale), float(self.v_scale))
        if self._scales is None or self._scales[0] != key:
            self._scales = (key, torch.tensor(key, dtype=torch.float32, device=self.key.device))
        return self._scales[1]

    @property
    def block_size(self) -> int:
        return self.key.shape[1]

    @property
    def is_fp8(self) -> bool:
        return self.key.dtype == torch.float8_e4m3fn
