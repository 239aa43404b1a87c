"""The fused MoE Triton kernel alone against its weight-read floor, on one GPU.

    python -m benchmarks.moe_kernel_bench           # also run by benchmarks.gpu_check

One MoE layer's experts (routing, both grouped GEMMs, the slot sum) at decode batch
sizes, for a Mixtral-8x7B layer (bf16) and a gpt-oss-20b layer (biases, clamped SwiGLU)
in bf16 and with its experts kept MXFP4 (decoded in the GEMM tiles). The floor is the
bytes of the experts the batch's tokens picked (each read once) plus the activations,
over the measured copy bandwidth: a decode step of a MoE model is bound by it. The MXFP4
rows also give their largest difference from the bf16 kernel on the same (dequantized)
weights.
"""

from __future__ import annotations

import sys

import torch

from benchmarks.attention_bench import _time_ms, gpu_main

# (name, experts, top_k, hidden, expert channels, gpt-oss (biases + clamped SwiGLU), MXFP4 experts)
SHAPES = [("mixtral-8x7b", 8, 2, 4096, 14336, False, False), ("gpt-oss-20b", 32, 4, 2880, 2880, True, False),
          ("gpt-oss-20b mxfp4", 32, 4, 2880, 2880, True, True)]
BATCHES = [1, 16, 64, 256]


def _random_mxfp4(E: int, rows: int, cols: int, g: torch.Generator, device: torch.device):
    """Random packed bytes and scales near 2^-3 (the values do not change the timing)."""
    packed = torch.randint(0, 256, (E, rows, cols // 2), generator=g, device=device, dtype=torch.uint8)
    scales = torch.randint(120, 125, (E, rows, cols // 32), generator=g, device=device, dtype=torch.uint8)
    return packed, scales


def bench_shape(name: str, E: int, k: int, H: int, I: int, gpt_oss: bool, mxfp4: bool, bandwidth_gbs: float,
                device: torch.device, batches=BATCHES, dtype: torch.dtype = torch.bfloat16, iters: int = 20) -> list[dict]:
    from backend.ops import fused_moe_triton as fm
    from backend.ops.moe_reference import unpack_mxfp4
    g = torch.Generator(device=device).manual_seed(0)
    kw: dict = {}
    if mxfp4:
        w13, s13 = _random_mxfp4(E, 2 * I, H, g, device)
        w2, s2 = _random_mxfp4(E, H, I, g, device)
        kw.update(w13_scale=s13, w2_scale=s2)
        dense = (unpack_mxfp4(w13, s13, dtype), unpack_mxfp4(w2, s2, dtype))
        expert_bytes = (2 * I * H + H * I) * 17 // 32                   # 4 bits + one byte per 32
    else:
        w13 = (torch.randn(E, 2 * I, H, generator=g, device=device) / H ** 0.5).to(dtype)
        w2 = (torch.randn(E, H, I, generator=g, device=device) / I ** 0.5).to(dtype)
        expert_bytes = (2 * I * H + H * I) * w13.element_size()
    act = "silu"
    if gpt_oss:
        act = "swigluoai"
        kw.update(b13=torch.randn(E, 2 * I, generator=g, device=device).to(dtype),
                  b2=torch.randn(E, H, generator=g, device=device).to(dtype))
        expert_bytes += (2 * I + H) * 2
    rows = []
    for batch in batches:
        x = torch.randn(batch, H, generator=g, device=device).to(dtype)
        logits = torch.randn(batch, E, generator=g, device=device)
        weights, ids = fm.route(logits, k, not gpt_oss, softmax_after_topk=gpt_oss)

        def run() -> torch.Tensor:
            return fm.fused_moe(x, w13, w2, weights, ids, act, **kw)
        ms = _time_ms(run, iters, device)
        touched = int(torch.unique(ids).numel())
        bytes_read = touched * expert_bytes + 2 * x.numel() * x.element_size()
        floor_ms = bytes_read / (bandwidth_gbs * 1e9) * 1e3
        row = {"shape": name, "batch": batch, "experts_read": touched, "ms": ms, "floor_ms": floor_ms,
               "x_floor": ms / floor_ms, "GB_per_s": bytes_read / ms / 1e6}
        if mxfp4:
            ref = fm.fused_moe(x, *dense, weights, ids, act, **{n: v for n, v in kw.items() if n.startswith("b")})
            row["max_abs_diff_vs_bf16"] = (run() - ref).abs().max().item()
        rows.append(row)
    return rows


def run(bandwidth_gbs: float, device: torch.device, shapes=SHAPES, **kw) -> list[dict]:
    return [r for shape in shapes for r in bench_shape(*shape, bandwidth_gbs, device, **kw)]


def render(rows: list[dict]) -> str:
    lines = ["| layer | batch | experts read | ms | floor ms | x floor | GB/s | MXFP4 vs bf16 max diff |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['batch']} | {r['experts_read']} | {r['ms']:.3f} | {r['floor_ms']:.3f} | "
              f"{r['x_floor']:.2f} | {r['GB_per_s']:.0f} | {r.get('max_abs_diff_vs_bf16', '')} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    return gpu_main("moe_kernel_bench", run, render, argv)


if __name__ == "__main__":
    sys.exit(main())
