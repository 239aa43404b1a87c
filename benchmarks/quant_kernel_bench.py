"""W8A8 INT8 GEMM, the INT4 weight-only GEMMs and the INT8 KV cache against bf16, on one
GPU (issues 33 and 50).

    python -m benchmarks.quant_kernel_bench         # also run by benchmarks.gpu_check

- W8A8: a Llama-3.1-8B layer's gate_up and down projections at decode and prefill row
  counts. The W8A8 time is what `W8A8Linear` does on CUDA: per-token activation
  quantization, then the Triton int8 GEMM (backend/ops/w8a8_gemm_triton.py); bf16 is
  `F.linear` (cuBLAS) on the same shape. Each row also gives the kernel's largest
  difference from the exact integer reference on the same quantized inputs.
- FP8: what `FP8Linear` does on CUDA with dynamic per-token activation scales (the
  rounding, then `torch._scaled_mm` with per-channel weight scales) on the W8A8 shapes;
  the difference is against bf16 `F.linear` on the dequantized weights.
- INT4 (GPTQ g128, groups in order): Llama-3.1-8B's projections at M = 1, 16, 64 and
  256 rows. bf16 `F.linear` against the gathering kernel (`int_gemm`, what act-order
  checkpoints run) and the blocked kernel (`int_gemm_blocked`, what the rest run), with
  the split of K the planner picks, and the best of a sweep of forced splits (to check
  `TILES` and `PROGRAMS_PER_SM`). The floor reads the packed weights, scales and zeros
  once; each timed call cycles through copies of the weights larger than L2 together.
- INT8 KV: the one-token paged attention kernel on decode shapes over an INT8 pool (per
  KV-head scales) and over a bf16 pool of the same blocks: half the K/V bytes read. The
  floor is the bf16 pool's bytes over the measured copy bandwidth.

Speed-up = bf16 ms / quantized ms. Never run on a GPU yet (no GPU lent to the session
that wrote it): on CPU it runs through the interpreter on tiny shapes only (its test).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.attention_bench import _time_ms, gpu_main

# (name, rows, in features, out features): Llama-3.1-8B's gate_up and down.
GEMM_SHAPES = [(f"{p} M={m}", m, k, n) for m in (1, 16, 256, 2048)
               for p, k, n in (("gate_up 4096x28672", 4096, 28672), ("down 14336x4096", 14336, 4096))]
# (name, rows, in features, out features): the 8B's fused q/k/v, o, gate_up and down.
INT4_SHAPES = [(f"{p} M={m}", m, k, n) for m in (1, 16, 64, 256)
               for p, k, n in (("qkv 4096x6144", 4096, 6144), ("o 4096x4096", 4096, 4096),
                               ("gate_up 4096x28672", 4096, 28672), ("down 14336x4096", 14336, 4096))]
INT4_SPLITS = (1, 2, 4, 8, 16)
L2_BYTES = 64 << 20             # more than an H100's or H200's L2 (50 MB)
# (name, sequences, context): decode steps of Llama-3.1-8B's attention (32/8 heads, dim 128).
KV_SHAPES = [("decode b1 ctx8192", 1, 8192), ("decode b64 ctx2048", 64, 2048), ("decode b256 ctx1024", 256, 1024)]


def _layer_rows(bandwidth_gbs: float, device: torch.device, shapes, dtype: torch.dtype, iters: int, key: str,
                make_layer) -> list[dict]:
    """A quantized layer against bf16 F.linear on each shape: make_layer(w) -> (the layer,
    its exact fp32 reference on x). The floor reads the 1-byte weights once."""
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, M, K, N in shapes:
        x = torch.randn(M, K, generator=g, device=device).to(dtype)
        w = (torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(dtype)
        layer, reference = make_layer(w)
        bf16_ms = _time_ms(lambda: F.linear(x, w), iters, device)
        ms = _time_ms(lambda: layer(x), iters, device)
        want = reference(x)
        floor_ms = (N * K + M * K * 2 + M * N * 2) / (bandwidth_gbs * 1e9) * 1e3
        rows.append({"shape": name, "bf16_ms": bf16_ms, f"{key}_ms": ms, "speedup": bf16_ms / ms,
                     "floor_ms": floor_ms, "x_floor": ms / floor_ms,
                     "max_rel_diff": ((layer(x).float() - want).abs().max() / want.abs().max()).item()})
    return rows


def w8a8_rows(bandwidth_gbs: float, device: torch.device, shapes=GEMM_SHAPES, dtype: torch.dtype = torch.bfloat16,
              iters: int = 20) -> list[dict]:
    """W8A8Linear's kernel path (the one-launch per-token rounding, the INT8 GEMM) against
    the exact integer reference on the same rounded inputs."""
    from backend.models.w8a8 import W8A8Linear, int8_gemm_reference, quantize_per_token

    def make(w):
        N, K = w.shape
        layer = W8A8Linear(K, N, bias=False, use_kernel=True).to(w.device)
        layer.weight.data, layer.weight_scale.data = quantize_per_token(w)  # per channel: the rule on w's rows
        return layer, lambda x: int8_gemm_reference(*quantize_per_token(x), layer.weight, layer.weight_scale, None,
                                                    torch.float32)
    return _layer_rows(bandwidth_gbs, device, shapes, dtype, iters, "w8a8", make)


def fp8_rows(bandwidth_gbs: float, device: torch.device, shapes=GEMM_SHAPES, dtype: torch.dtype = torch.bfloat16,
             iters: int = 20) -> list[dict]:
    """FP8Linear with dynamic per-token scales against F.linear on its dequantized weights."""
    from backend.models.fp8 import FP8Linear, quantize_per_channel

    def make(w):
        N, K = w.shape
        layer = FP8Linear(K, N, bias=False, dynamic=True).to(w.device)
        layer.weight.data, layer.weight_scale.data = quantize_per_channel(w)
        dequantized = layer.weight.float() * layer.weight_scale[:, None]
        return layer, lambda x: F.linear(x.float(), dequantized)
    return _layer_rows(bandwidth_gbs, device, shapes, dtype, iters, "fp8", make)


def int4_rows(bandwidth_gbs: float, device: torch.device, shapes=INT4_SHAPES, dtype: torch.dtype = torch.bfloat16,
              iters: int = 20, group_size: int = 128, splits=INT4_SPLITS) -> list[dict]:
    from backend.models.int_formats import unpack
    from backend.ops.int_gemm_triton import block_for_kernel, int_gemm, int_gemm_blocked
    g = torch.Generator(device=device).manual_seed(0)
    element = torch.tensor([], dtype=dtype).element_size()
    made: dict[tuple[int, int], tuple] = {}         # (K, N) -> (packed copies, dense copies), kept across M

    def weights(K: int, N: int) -> tuple:
        if (K, N) not in made:
            groups = K // group_size
            packed_bytes = N * K // 2 + groups * N * (element + 4)
            packed = []
            for _ in range(max(1, -(-L2_BYTES // packed_bytes))):
                words = torch.randint(-2 ** 31, 2 ** 31 - 1, (K // 8, N), generator=g, device=device,
                                      dtype=torch.int32)                   # random words: random 4-bit codes
                scales = (torch.rand(groups, N, generator=g, device=device) * 0.02 + 0.001).to(dtype)
                zeros = torch.randint(0, 16, (groups, N), generator=g, device=device).float()
                packed.append((words, block_for_kernel(words, 4), scales, zeros))
            dense = [(torch.randn(N, K, generator=g, device=device) / K ** 0.5).to(dtype)
                     for _ in range(max(1, -(-L2_BYTES // (N * K * element))))]
            made[(K, N)] = (packed, dense, packed_bytes)
        return made[(K, N)]

    def cycling(fn, pool):
        turn = iter(range(1 << 30))
        return lambda: fn(pool[next(turn) % len(pool)])
    rows = []
    for name, M, K, N in shapes:
        packed, dense, packed_bytes = weights(K, N)
        g_idx = (torch.arange(K, device=device) // group_size).to(torch.int32)
        x = torch.randn(M, K, generator=g, device=device).to(dtype)
        bf16_ms = _time_ms(cycling(lambda w: F.linear(x, w), dense), iters, device)
        gather_ms = _time_ms(cycling(lambda w: int_gemm(x, w[0], w[2], w[3], g_idx, 4), packed), iters, device)
        blocked_ms = _time_ms(cycling(lambda w: int_gemm_blocked(x, w[1], w[2], w[3], 4, group_size), packed),
                              iters, device)
        forced = {k: _time_ms(cycling(lambda w, k=k: int_gemm_blocked(x, w[1], w[2], w[3], 4, group_size, split_k=k),
                                      packed), iters, device) for k in splits}
        best = min(forced, key=forced.get)
        words, blocked, scales, zeros = packed[0]
        groups = g_idx.long()
        ref = F.linear(x.float(), ((unpack(words, 4, dim=0).float() - zeros[groups]) * scales.float()[groups]).t())
        got = int_gemm_blocked(x, blocked, scales, zeros, 4, group_size).float()
        floor_ms = (packed_bytes + M * K * element + M * N * element) / (bandwidth_gbs * 1e9) * 1e3
        rows.append({"shape": name, "bf16_ms": bf16_ms, "gather_ms": gather_ms, "blocked_ms": blocked_ms,
                     "speedup": bf16_ms / blocked_ms, "floor_ms": floor_ms, "x_floor": blocked_ms / floor_ms,
                     "best_split": best, "best_split_ms": forced[best],
                     "max_rel_diff": ((got - ref).abs().max() / ref.abs().max()).item()})
    return rows


def int8_kv_rows(bandwidth_gbs: float, device: torch.device, shapes=KV_SHAPES, heads: int = 32, kv_heads: int = 8,
                 head_dim: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                 iters: int = 20) -> list[dict]:
    from backend.attention.torch_attention import quantize_int8
    from backend.attention.triton_attention import choose_num_splits, launch_paged_attention
    g = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, num_seqs, ctx in shapes:
        seq_len = ctx + 1
        per_seq = -(-seq_len // block_size)
        num_blocks = num_seqs * per_seq + 1
        k_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
        v_pool = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
        k_scale = k_pool.float().abs().amax(dim=(0, 1, 3)) / 127.0          # per KV head
        v_scale = v_pool.float().abs().amax(dim=(0, 1, 3)) / 127.0
        k8, v8 = quantize_int8(k_pool, k_scale), quantize_int8(v_pool, v_scale)
        perm = torch.randperm(num_blocks - 1, generator=g, device=device) + 1
        tables = perm[:num_seqs * per_seq].view(num_seqs, per_seq).to(torch.int32)
        q = torch.randn(num_seqs, heads, head_dim, generator=g, device=device).to(dtype)
        k = torch.randn(num_seqs, kv_heads, head_dim, generator=g, device=device).to(dtype)
        v = torch.randn(num_seqs, kv_heads, head_dim, generator=g, device=device).to(dtype)
        slots = torch.full((num_seqs,), -1, dtype=torch.int32, device=device)   # timing only: write nothing
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        ones = torch.ones(1, dtype=torch.float32, device=device)
        splits = choose_num_splits(num_seqs, kv_heads, seq_len, block_size)
        scale = head_dim ** -0.5
        out16, out8 = torch.empty_like(q), torch.empty_like(q)

        def bf16() -> None:
            launch_paged_attention(q, k, v, k_pool, v_pool, slots, tables, seq_lens, qsl, ones, ones, out16, scale,
                                   None, splits)

        def int8() -> None:
            launch_paged_attention(q, k, v, k8, v8, slots, tables, seq_lens, qsl, k_scale, v_scale, out8, scale,
                                   None, splits)
        bf16_ms, ms = _time_ms(bf16, iters, device), _time_ms(int8, iters, device)
        bytes16 = num_seqs * seq_len * kv_heads * head_dim * 2 * torch.tensor([], dtype=dtype).element_size()
        floor_ms = bytes16 / (bandwidth_gbs * 1e9) * 1e3
        rows.append({"shape": name, "bf16_ms": bf16_ms, "int8_ms": ms, "speedup": bf16_ms / ms,
                     "bf16_floor_ms": floor_ms, "int8_floor_ms": floor_ms / 2,
                     "max_abs_diff_vs_bf16": (out8.float() - out16.float()).abs().max().item()})
    return rows


def run(bandwidth_gbs: float, device: torch.device, gemm_shapes=GEMM_SHAPES, kv_shapes=KV_SHAPES,
        int4_shapes=INT4_SHAPES, int4_splits=INT4_SPLITS, **kw) -> dict:
    return {"w8a8": w8a8_rows(bandwidth_gbs, device, gemm_shapes, **kw),
            "fp8": fp8_rows(bandwidth_gbs, device, gemm_shapes, **kw),
            "int4": int4_rows(bandwidth_gbs, device, int4_shapes, splits=int4_splits, **kw),
            "int8_kv": int8_kv_rows(bandwidth_gbs, device, kv_shapes, **kw)}


def render(report: dict) -> str:
    lines = ["| W8A8 GEMM | bf16 ms | W8A8 ms | speed-up | floor ms | x floor | max rel diff vs exact |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['w8a8_ms']:.3f} | {r['speedup']:.2f} | {r['floor_ms']:.3f} | "
              f"{r['x_floor']:.2f} | {r['max_rel_diff']:.2g} |" for r in report["w8a8"]]
    lines += ["", "| FP8 GEMM (dynamic per token) | bf16 ms | FP8 ms | speed-up | floor ms | x floor | max rel diff |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['fp8_ms']:.3f} | {r['speedup']:.2f} | {r['floor_ms']:.3f} | "
              f"{r['x_floor']:.2f} | {r['max_rel_diff']:.2g} |" for r in report.get("fp8", [])]
    lines += ["", "| INT4 GEMM (g128) | bf16 ms | gathering ms | blocked ms | speed-up | floor ms | x floor | "
              "best forced split (ms) | max rel diff |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['gather_ms']:.3f} | {r['blocked_ms']:.3f} | "
              f"{r['speedup']:.2f} | {r['floor_ms']:.3f} | {r['x_floor']:.2f} | {r['best_split']} "
              f"({r['best_split_ms']:.3f}) | {r['max_rel_diff']:.2g} |" for r in report.get("int4", [])]
    lines += ["", "| INT8 KV attention | bf16 ms | INT8 ms | speed-up | bf16 floor ms | INT8 floor ms | max diff |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['bf16_ms']:.3f} | {r['int8_ms']:.3f} | {r['speedup']:.2f} | "
              f"{r['bf16_floor_ms']:.3f} | {r['int8_floor_ms']:.3f} | {r['max_abs_diff_vs_bf16']:.2g} |"
              for r in report["int8_kv"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    return gpu_main("quant_kernel_bench", run, render, argv)


if __name__ == "__main__":
    sys.exit(main())
