"""Weight-only INT4/INT8 linear layers (W4A16 / W8A16) over the one packed layout of
backend/models/int_formats.py (bitsandbytes NF4/FP4 too: codes with a value table).

On CUDA (and with attention_backend="triton" anywhere) the matmul is a Triton kernel of
backend/ops/int_gemm_triton.py, which unpacks and dequantizes each weight tile in
registers: the weights stay packed in memory (4 or 8 bits each). Where the groups allow
(no act order; groups of 128 4-bit or 64 8-bit rows, or per channel) qweight is re-packed
in place for the blocked kernel at load (pack_weights; at the first kernel call where a
loader does not call it); it then serves that kernel only.
The torch path (CPU) dequantizes once and keeps the result: it is the correctness
reference, the checkpoint is what is smaller.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from backend.models import int_formats
from backend.models.int_formats import IntScheme, IntWeight
from backend.models.projections import FUSED_PROJECTIONS
from backend.models.weight_format import WeightFormat


class IntLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: IntScheme, use_kernel: bool,
                 part_sizes: list[int]) -> None:
        """part_sizes: the output widths of the projections fused here (q/k/v, gate/up)."""
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.use_kernel = scheme.bits, use_kernel
        self.group_size = scheme.group_size
        self.part_sizes = part_sizes
        groups = 1 if scheme.group_size == -1 else -(-in_features // scheme.group_size)
        p = lambda *shape, dtype=torch.float32: nn.Parameter(torch.empty(*shape, dtype=dtype),  # noqa: E731
                                                             requires_grad=False)
        self.qweight = p(in_features // scheme.pack, out_features, dtype=torch.int32)
        self.scales = p(groups, out_features)
        # bitsandbytes NF4/FP4: w = quant_map[q] * scale, no zeros to keep.
        self.zeros = None if scheme.lookup else p(groups, out_features)
        self.g_idx = p(len(part_sizes), in_features, dtype=torch.int32)       # each part's own act order
        self.bias = p(out_features) if bias else None
        self.quant_map = p(16) if scheme.lookup else None       # bitsandbytes NF4/FP4 code values
        self._dequantized: Optional[torch.Tensor] = None
        self._shared_groups: Optional[bool] = None
        self._blocked = False               # qweight re-packed for int_gemm_blocked (kernel path only)

    def weight_only(self) -> IntWeight:
        return IntWeight(self.qweight, self.scales, self.zeros, self.g_idx, self.bias, self.quant_map)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.use_kernel or x.is_cuda:
            from backend.ops.int_gemm_triton import int_gemm, int_gemm_blocked
            if self._shared_groups is None:         # not prepared at load (pack_weights): at the first call
                self.prepare_kernel()
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            if self._blocked:
                int_gemm_blocked(x, self.qweight, self.scales, self.zeros, self.bits, self.group_size, out)
                return out if bias is None else out + bias
            bounds = [(0, self.out_features)] if self._shared_groups else int_formats.part_bounds(self.part_sizes)
            for part, (a, b) in enumerate(bounds):
                zeros = None if self.zeros is None else self.zeros[:, a:b]
                int_gemm(x, self.qweight[:, a:b], self.scales[:, a:b], zeros, self.g_idx[part], self.bits, out[:, a:b],
                         self.quant_map)
            return out if bias is None else out + bias
        assert not self._blocked, "qweight was re-packed for the Triton kernel"
        if self._dequantized is None or self._dequantized.dtype != x.dtype:
            self._dequantized = int_formats.dequantize(self.weight_only(), self.bits, self.part_sizes).to(x.dtype)
        return F.linear(x, self._dequantized, bias)

    def runs_kernel(self) -> bool:
        return self.use_kernel or self.qweight.is_cuda

    def prepare_kernel(self) -> None:
        """One launch if the parts' groups agree; the blocked kernel's layout if they are
        in order (g_idx = row // group_size) in sizes it takes. Reads g_idx once: at load
        (prepare_kernel_layouts), so that sleep mode's reloaded weights get the same layout."""
        from backend.ops.int_gemm_triton import block_for_kernel, blocked_eligible
        self._shared_groups = bool((self.g_idx == self.g_idx[:1]).all())
        K = self.in_features
        in_order = torch.arange(K, device=self.g_idx.device) // (K if self.group_size == -1 else self.group_size)
        if (self._shared_groups and self.quant_map is None and blocked_eligible(K, self.bits, self.group_size)
                and bool((self.g_idx[0] == in_order).all())):
            self.qweight.data = block_for_kernel(self.qweight.data, self.bits)
            self._blocked = True


def prepare_kernel_layouts(model: nn.Module) -> None:
    """Every IntLinear that runs the Triton kernel, prepared once its weights are loaded."""
    for module in model.modules():
        if isinstance(module, IntLinear) and module.runs_kernel() and module._shared_groups is None:
            module.prepare_kernel()


def swap_in_int_linears(model: nn.Module, scheme: IntScheme, use_kernel: bool) -> None:
    """The decoder's projections (not embeddings or the LM head) as IntLinear."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = {(attn, "qkv_proj"): [attn.q_size, attn.kv_size, attn.kv_size], (attn, "o_proj"): None,
                 (mlp, "gate_up_proj"): [mlp.gate_up_proj.out_features // 2] * 2, (mlp, "down_proj"): None}
        for (parent, name), sizes in parts.items():
            lin = getattr(parent, name)
            with torch.device(lin.weight.device):
                setattr(parent, name, IntLinear(lin.in_features, lin.out_features, lin.bias is not None, scheme,
                                                use_kernel, sizes or [lin.out_features]))


def int_state_dict(state: dict[str, torch.Tensor], num_layers: int, scheme: IntScheme) -> dict[str, torch.Tensor]:
    """The checkpoint's quantized projections (popped from `state`) as the fused IntLinear
    parameters; every other tensor stays as it is."""
    fused = dict(FUSED_PROJECTIONS)
    fused.update({"self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",)})
    for i in range(num_layers):
        for target, parts in fused.items():
            w = int_formats.concat([int_formats.read_projection(state, f"model.layers.{i}.{p}", scheme)
                                    for p in parts])
            for field in ("qweight", "scales", "zeros", "g_idx", "bias", "quant_map"):
                value = getattr(w, field)
                if value is not None:
                    state[f"model.layers.{i}.{target}.{field}"] = value
    return state


class IntFormat(WeightFormat):
    summary = ("weight-only INT4/INT8: " + ", ".join(int_formats.METHODS)
               + " (compressed-tensors pack-quantized; bitsandbytes NF4/FP4)")
    linear_classes = (IntLinear,)

    def scheme_of(self, quant: dict[str, Any]) -> Optional[IntScheme]:
        return int_formats.scheme_of(quant)

    def describe(self, scheme: IntScheme) -> str:
        return f"{scheme.method} INT{scheme.bits}"

    def swap_in(self, model: nn.Module, scheme: IntScheme, use_kernel: bool) -> None:
        swap_in_int_linears(model, scheme, use_kernel)

    def state_dict(self, state: dict[str, torch.Tensor], num_layers: int, scheme: IntScheme
                   ) -> dict[str, torch.Tensor]:
        return int_state_dict(state, num_layers, scheme)
