"""What the INT4 weight-only, the W8A8 and the MXFP4 MoE GEMMs cost a Hopper SM, read
from the compiler without a GPU: Triton compiles each kernel for sm_90 at the launch's
tile sizes (the `TILES` of int_gemm_triton.py and w8a8_gemm_triton.py, fused_moe's
blocks and warps), ptxas -v reports registers, spills and shared memory, and the PTX is
counted for the instructions that bound a memory-bound GEMM (global loads, tensor-core
MMAs, integer-to-float converts of the weights, exp2s). Occupancy follows: 65,536
registers and 228 KB of shared memory per SM.

    python -m benchmarks.kernel_resources            # run without TRITON_INTERPRET

A stand-in for timing where no GPU is lent (the timing is benchmarks/quant_kernel_bench.py).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

REGISTERS_PER_SM, SHARED_PER_SM, MAX_THREADS_PER_SM = 65536, 228 * 1024, 2048
COUNTED = {"mma": r"\bmma\.sync|\bwgmma\.mma_async", "weight_converts": r"cvt\.rn\.(?:f32|f16|bf16)\.[us]32",
           "global_loads": r"\bld\.global|\bcp\.async\.(?:ca|cg)", "async_copies": r"\bcp\.async\.(?:ca|cg)",
           "exp2": r"\bex2\.approx"}


# Integer arguments that count rows: a launch sees any value, so they are not taken as
# multiples of 16 (every other integer, a stride or a width at the models' shapes, is).
ROW_COUNTS = frozenset({"M", "T", "num_seqs", "num_slots", "num_tokens"})


def launch_attrs(fn, types: dict, consts: dict, odd=ROW_COUNTS) -> dict:
    """The specialization a launch gives: Triton marks each tensor whose address and each
    integer whose value is a multiple of 16 (torch's allocations are; so are the strides
    and widths of the models' shapes), and only then vectorizes loads into 16-byte
    accesses and pipelines a K loop through cp.async. Without it the compile is not the
    one a GPU runs (no pipelining, other registers)."""
    names = list(fn.arg_names)
    return {(names.index(name),): [["tt.divisibility", 16]] for name, ty in types.items()
            if name not in odd and name not in consts and (ty.startswith("*") or ty in ("i32", "i64"))}


def compile_sm90(fn, types: dict, consts: dict, num_warps: int = 4, num_stages: int = 3, odd=ROW_COUNTS):
    """fn compiled for sm_90 as a launch specializes it (launch_attrs; `odd`: integers not
    taken as multiples of 16), with Triton's default warps and stages unless given."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**types, **{k: "constexpr" for k in consts}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=launch_attrs(fn, types, consts, odd)),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def ptxas_usage(ptx: str) -> dict:
    """{registers, spill_bytes} from ptxas -v (the ptxas Triton itself uses for sm_90)."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        proc = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    text = proc.stdout + proc.stderr
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return {"registers": int(re.search(r"Used (\d+) registers", text).group(1)), "spill_bytes": spills}


def int4_kernels(dtype: str = "bf16", rows=(1, 64, 256)) -> list[dict]:
    """The gathering and the blocked 4-bit kernel at each M bucket's tiles."""
    from backend.ops import int_gemm_triton as ig
    from backend.ops.gemm_tiles import tile_config
    act = f"*{dtype}"
    scalars = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_qk", "stride_sg", "stride_om", "stride_os",
                                  "K_PER_SPLIT")}
    magic = dict(MAGIC=0x4300, OFFSET=128.0) if dtype == "bf16" else dict(MAGIC=0x6400, OFFSET=1024.0)
    out = []
    for m in rows:
        block_m, block_n, warps, stages = tile_config(m, ig.TILES)
        kernels = {
            "gathering": (ig._int_gemm_kernel,
                          {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": act, "z_ptr": "*fp32", "g_ptr": "*i32",
                           "out_ptr": act, **scalars},
                          dict(BITS=4, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, lut_ptr=None, LUT=False,
                               IEEE=False), 64),
            "blocked": (ig._int_gemm_blocked_kernel,
                        {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": act, "z_ptr": "*fp32", "out_ptr": act, **scalars},
                        dict(BITS=4, GROUP_SIZE=128, BLOCK_M=block_m, BLOCK_N=block_n, IEEE=False, **magic), 128)}
        for name, (fn, types, consts, block_k) in kernels.items():
            out.append(_row(name, m, fn, types, consts, (block_m, block_n, warps, stages), block_k))
    return out


def _row(kernel: str, m: int, fn, types: dict, consts: dict, tile: tuple, block_k: int) -> dict:
    block_m, block_n, warps, stages = tile
    compiled = compile_sm90(fn, types, consts, warps, stages)
    ptx = compiled.asm["ptx"]
    usage = ptxas_usage(ptx)
    threads = warps * 32
    blocks = min(REGISTERS_PER_SM // (usage["registers"] * threads), MAX_THREADS_PER_SM // threads,
                 SHARED_PER_SM // max(1, compiled.metadata.shared))
    return {"kernel": kernel, "M": m, "tile": f"{block_m}x{block_n}x{block_k}", "warps": warps, "stages": stages,
            **usage, "shared_bytes": compiled.metadata.shared, "blocks_per_sm": blocks,
            **{k: len(re.findall(p, ptx)) for k, p in COUNTED.items()}}


def w8a8_kernels(dtype: str = "bf16", rows=(1, 64, 256)) -> list[dict]:
    """The W8A8 INT8 GEMM at each M bucket's tiles."""
    from backend.ops import w8a8_gemm_triton as w
    from backend.ops.gemm_tiles import tile_config
    types = {"x_ptr": "*i8", "w_ptr": "*i8", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "b_ptr": f"*{dtype}",
             "out_ptr": f"*{dtype}", **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om",
                                                           "stride_os", "K_PER_SPLIT")}}
    out = []
    for m in rows:
        tile = tile_config(m, w.TILES)
        out.append(_row("w8a8", m, w._w8a8_gemm_kernel, types,
                        dict(HAS_BIAS=False, BLOCK_M=tile[0], BLOCK_N=tile[1], BLOCK_K=w.BLOCK_K), tile, w.BLOCK_K))
    return out


def mxfp4_moe_kernels(rows=(16, 64)) -> list[dict]:
    """gpt-oss's gate_up program (biases, clamped SwiGLU) over MXFP4 experts at fused_moe's
    two block heights, 4 warps as fused_moe launches it: the codes decoded by
    load_weight_tile (the fp32 path's) against `tl.dot_scaled`."""
    from backend.ops import fused_moe_triton as m
    types = {"a_ptr": "*bf16", "w_ptr": "*u8", "out_ptr": "*bf16", "sorted_ids_ptr": "*i32",
             "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32", "bias_ptr": "*bf16",
             "w_scale_ptr": "*u8", **{n: "i32" for n in ("N", "K", "num_slots", "stride_am", "stride_we", "stride_wn",
                                                         "stride_om", "stride_be", "stride_se", "stride_sn")}}
    out = []
    for block_m in rows:
        for name, scaled_dot in (("mxfp4 decoded", False), ("mxfp4 dot_scaled", True)):
            consts = dict(A_ROW_DIV=4, GATED=True, MUL_WEIGHT=False, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                          IEEE=False, HAS_BIAS=True, SWIGLU_OAI=True, ALPHA=1.702, LIMIT=7.0, MXFP4=True, FP8=False,
                          SCALED_DOT=scaled_dot)
            out.append(_row(name, block_m, m._grouped_gemm_kernel, types, consts, (block_m, 64, 4, 3), 64))
    return out


def render(rows: list[dict]) -> str:
    lines = ["| kernel | M | tile (MxNxK) | warps | registers | spills (B) | shared (B) | blocks/SM | "
             "MMAs | weight converts | global loads | exp2 | cp.async |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['M']} | {r['tile']} | {r['warps']} | {r['registers']} | {r['spill_bytes']} | "
              f"{r['shared_bytes']} | {r['blocks_per_sm']} | {r['mma']} | {r['weight_converts']} | "
              f"{r['global_loads']} | {r['exp2']} | {r['async_copies']} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernel_resources", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256], help="M of each tile bucket to compile")
    ap.add_argument("--moe-rows", type=int, nargs="*", default=[16, 64],
                    help="fused MoE block heights to compile (bf16 MXFP4 experts)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile for sm_90")
        return 2
    print(render(int4_kernels(a.dtype, a.rows) + w8a8_kernels(a.dtype, a.rows) + mxfp4_moe_kernels(a.moe_rows)))
    print("\nMMAs, converts, loads, exp2s and cp.async copies (a K loop pipelined through shared memory) are "
          "counted in the PTX (a loop body may be unrolled or pipelined); "
          "W8A8's converts are its epilogue's int32 sums, not weights, and the MoE's exp2s include its "
          "SwiGLU's sigmoid; blocks/SM is the occupancy limit of registers, threads and shared memory; the "
          "MoE rows' M is the block height.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
