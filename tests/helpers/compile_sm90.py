"""Compile the engine's Triton kernels for Hopper (sm_90) without a GPU: catches what the
interpreter cannot (tl.dot shape and dtype rules, type errors of the real compiler).
Run without TRITON_INTERPRET:  python -m tests.helpers.compile_sm90"""

from __future__ import annotations

import os
import re
import sys


# The most shared memory one block may take on an H100 or H200 (227 KiB): a launch that
# asks for more fails there (the H100 run of 2026-11-27 met one).
MAX_SHARED = 227 * 1024


def compile_kernel(fn, types: dict, consts: dict):
    """fn compiled for sm_90 as a launch on aligned tensors compiles it (pipelined K loops
    included), checked to fit an SM's shared memory."""
    from benchmarks.kernel_resources import compile_sm90
    compiled = compile_sm90(fn, types, consts)
    assert compiled.metadata.shared <= MAX_SHARED, \
        f"{fn.__name__} {consts} needs {compiled.metadata.shared} bytes of shared memory (at most {MAX_SHARED})"
    return compiled


def tiled_attention(dtype: str, fp8: bool, window: int, block_m: int = 0, soft_cap: float = 0.0,
                    int8: bool = False, sinks: bool = False) -> dict:
    from backend.attention import triton_tiled as tt
    act, pool = f"*{dtype}", ("*u8" if fp8 else "*i8" if int8 else f"*{dtype}")
    types = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "k_cache_ptr": pool, "v_cache_ptr": pool,
             "slot_ptr": "*i32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             **{n: "i32" for n in ("num_seqs", "stride_bt", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                   "stride_vt", "stride_vh", "stride_ot", "stride_oh")},
             "out_ptr": act, "k_cache_out_ptr": pool, "v_cache_out_ptr": pool,
             **({"sinks_ptr": act} if sinks else {})}
    consts = dict(NUM_KV_HEADS=8, GROUP=4, BLOCK_G=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, SM_SCALE=128 ** -0.5,
                  SLIDING_WINDOW=window, FP8=fp8, BLOCK_M=block_m or tt.BLOCK_M, BLOCK_N=tt.BLOCK_N,
                  IEEE=dtype == "fp32", SOFTCAP=soft_cap, INT8=int8, HAS_SINKS=sinks,
                  **({} if sinks else {"sinks_ptr": None}))
    return compile_kernel(tt._tiled_attention_kernel, types, consts)


def int8_kv_attention(dtype: str) -> list:
    """Both attention kernels over an INT8 cache with per-head scales: the tiled one (a
    window too) and the one-token decode kernel with split-KV partials."""
    from backend.attention import aot, triton_attention as ta
    types = {**aot.plugin_signature(dtype, False), "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
    types.update({k: "*i8" for k in ("k_cache_ptr", "v_cache_ptr", "k_cache_out_ptr", "v_cache_out_ptr")})
    decode = compile_kernel(ta._paged_attention_kernel, types,
                            {**ta.attention_constexprs(32, 8, 128, 16, 128 ** -0.5, None, False, 4, int8=True),
                             "sinks_ptr": None, "limits_ptr": None, "tree_ptr": None})
    return [tiled_attention(dtype, False, 0, int8=True), tiled_attention(dtype, False, 4096, int8=True), decode]


def key_limits_attention(dtype: str) -> list:
    """The one-token kernel with key limits (Gemma 3's image tokens, HAS_LIMITS) and a
    sliding window, as a step with an image prompt launches it: one split, and four."""
    from backend.attention import aot, triton_attention as ta
    types = {**aot.plugin_signature(dtype, False), "limits_ptr": "*i32"}
    one = compile_kernel(ta._paged_attention_kernel, types,
                         {**ta.attention_constexprs(8, 4, 256, 16, 256 ** -0.5, 1024, False, 1, limits=True),
                          "sinks_ptr": None, "part_acc_ptr": None, "part_ml_ptr": None, "tree_ptr": None})
    split = compile_kernel(ta._paged_attention_kernel, {**types, "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"},
                           {**ta.attention_constexprs(8, 4, 256, 16, 256 ** -0.5, 1024, False, 4, limits=True),
                            "sinks_ptr": None, "tree_ptr": None})
    return [one, split]


def layer_ops(dtype: str) -> list:
    from backend.ops import triton_kernels as k
    act = f"*{dtype}"
    norm = compile_kernel(k._add_rms_norm_kernel,
                          {"x_ptr": act, "res_ptr": act, "w_ptr": act, "out_ptr": act, "res_out_ptr": act,
                           "stride_x": "i32", "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32", "N": "i32",
                           "eps": "fp32"}, dict(HAS_RESIDUAL=True, BLOCK=4096, WEIGHT_FIRST=False))
    # gpt-oss: fp32 norm weights on bf16 activations, multiplied before rounding.
    norm_fp32_weight = compile_kernel(k._add_rms_norm_kernel,
                                      {"x_ptr": act, "res_ptr": act, "w_ptr": "*fp32", "out_ptr": act,
                                       "res_out_ptr": act, "stride_x": "i32", "stride_r": "i32", "stride_o": "i32",
                                       "stride_ro": "i32", "N": "i32", "eps": "fp32"},
                                      dict(HAS_RESIDUAL=True, BLOCK=4096, WEIGHT_FIRST=True))
    out = [norm, norm_fp32_weight]
    for qk_norm in (False, True):
        out.append(compile_kernel(k._rotary_kernel,
                                  {"q_ptr": act, "k_ptr": act, "pos_ptr": "*i32", "cos_ptr": act, "sin_ptr": act,
                                   "qw_ptr": act, "kw_ptr": act, "stride_qt": "i32", "stride_qh": "i32",
                                   "stride_kt": "i32", "stride_kh": "i32", "stride_cos": "i32", "eps": "fp32"},
                                  dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_HALF=64, BLOCK_HQ=32, BLOCK_HK=8,
                                       QK_NORM=qk_norm)))
    out.append(compile_kernel(k._silu_and_mul_kernel, {"x_ptr": act, "out_ptr": act, "stride_x": "i32",
                                                       "stride_o": "i32", "N": "i32"}, dict(BLOCK=1024)))
    return out


def lora_and_int_gemm(dtype: str) -> list:
    """The LoRA SGMV kernel (shrink and expand) and the W4A16 / W8A16 GEMM (and NF4/FP4)."""
    from backend.ops import int_gemm_triton, lora_triton
    act = f"*{dtype}"
    sgmv = {"x_ptr": act, "w_ptr": act, "out_ptr": act, "rows_ptr": "*i32", "starts_ptr": "*i32",
            "scaling_ptr": "*fp32", **{n: "i32" for n in ("N", "K", "stride_x", "stride_ws", "stride_wn", "stride_o",
                                                          "SLICE1", "SLICE2")}}
    out = [compile_kernel(lora_triton._sgmv_kernel, sgmv, dict(ADD=add, IEEE=dtype == "fp32", BLOCK_M=16, BLOCK_N=64,
                                                               BLOCK_K=64, NUM_SLICES=slices, RANK=16))
           for add, slices in ((False, 1), (True, 1), (True, 3))]
    strides = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_qk", "stride_sg", "stride_om", "stride_os",
                                  "K_PER_SPLIT")}
    gemm = {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp32", "g_ptr": "*i32", "out_ptr": act,
            **strides}
    out += [compile_kernel(int_gemm_triton._int_gemm_kernel, gemm, dict(BITS=bits, BLOCK_M=16, BLOCK_N=64,
                                                                           BLOCK_K=64, lut_ptr=None, LUT=False,
                                                                           IEEE=dtype == "fp32"))
            for bits in (4, 8)]
    # bitsandbytes NF4/FP4: the codes' values from a 16-entry table (its tiles are checked for MMA).
    out.append(compile_kernel(int_gemm_triton._int_gemm_kernel, {**gemm, "s_ptr": "*fp32", "lut_ptr": "*fp32"},
                              dict(BITS=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, LUT=True, IEEE=dtype == "fp32")))
    from backend.ops import gemm_tiles
    out.append(compile_kernel(gemm_tiles._sum_splits_kernel,
                              {"part_ptr": "*fp32", "out_ptr": act, "N": "i32", "stride_pm": "i32", "stride_ps": "i32",
                               "stride_om": "i32"}, dict(SPLITS=5, BLOCK=1024)))
    return out


def int_gemm_blocked(dtype: str) -> list:
    """The blocked W4A16 / W8A16 GEMM over the re-packed layout: 4-bit with the mantissa
    trick on a decode tile and a prefill tile (split K's fp32 partials), 8-bit converted."""
    from backend.ops import int_gemm_triton as ig
    act = f"*{dtype}"
    types = {"x_ptr": act, "qw_ptr": "*i32", "s_ptr": act, "z_ptr": "*fp32", "out_ptr": act,
             **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_qk", "stride_sg", "stride_om", "stride_os",
                                   "K_PER_SPLIT")}}
    magic = dict(MAGIC=0x4300, OFFSET=128.0) if dtype == "bf16" else dict(MAGIC=0x6400, OFFSET=1024.0)
    return [compile_kernel(ig._int_gemm_blocked_kernel, {**types, "out_ptr": out},
                           dict(BITS=bits, GROUP_SIZE=128, BLOCK_M=bm, BLOCK_N=bn, IEEE=False,
                                **(magic if bits == 4 else dict(MAGIC=0, OFFSET=0.0))))
            for bits, bm, bn, out in ((4, 16, 64, "*fp32"), (4, 64, 128, act), (8, 16, 64, act))]


def quant_rows(dtype: str) -> list:
    """The one-launch activation quantizer: INT8 per token, FP8 per token, FP8 per group of 128."""
    from backend.ops import quant_rows_triton as qr
    types = {"x_ptr": f"*{dtype}", "s_ptr": "*fp32", "K": "i32", "stride_x": "i32", "stride_q": "i32",
             "stride_s": "i32"}
    return [compile_kernel(qr._quant_rows_kernel, {**types, "q_ptr": "*fp8e4nv" if fp8 else "*i8"},
                           dict(GROUP=group, BLOCK=min(group, 2048), FP8=fp8, STATIC=False,
                                MIN_AMAX=1e-12 if fp8 else 1e-10, QMAX=448.0 if fp8 else 127.0))
            for fp8, group in ((False, 4096), (True, 4096), (True, 128))]


def w8a8_gemm(dtype: str) -> list:
    """The W8A8 INT8 GEMM (int8 x int8 -> int32), with and without a bias."""
    from backend.ops import w8a8_gemm_triton as w
    types = {"x_ptr": "*i8", "w_ptr": "*i8", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "b_ptr": f"*{dtype}",
             "out_ptr": f"*{dtype}", **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_om",
                                                           "stride_os", "K_PER_SPLIT")}}
    return [compile_kernel(w._w8a8_gemm_kernel, {**types, "out_ptr": out},
                           dict(HAS_BIAS=bias, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=w.BLOCK_K))
            for bias, bm, bn, out in ((False, 16, 64, "*fp32"), (True, 128, 128, f"*{dtype}"))]


def fp8_block_gemm(dtype: str) -> list:
    """The block-wise FP8 GEMM (128x128 blocks: 64-wide K steps inside each scale group)."""
    from backend.ops import fp8_block_gemm_triton as f
    types = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32", "b_ptr": f"*{dtype}",
             "out_ptr": f"*{dtype}", **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_wn", "stride_xs",
                                                           "stride_ws", "stride_om")}}
    return [compile_kernel(f._fp8_block_gemm_kernel, types,
                           dict(GROUP_K=128, HAS_BIAS=bias, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64))
            for bias, bm in ((False, 16), (True, 64))]


def fused_moe(dtype: str, gpt_oss: bool = False, mxfp4: bool = False, fp8: bool = False,
              scaled_dot: bool = False) -> list:
    """The fused MoE grouped GEMM (gate_up with SiLU-and-mul, down with the routing
    weights) and the routing kernel; gpt_oss: with expert biases and the clamped
    SwiGLU, and routing by top-k logits then softmax; mxfp4: weights decoded from
    packed bytes and E8M0 scales in the tiles (scaled_dot: by `tl.dot_scaled`); fp8: E4M3 weights times their per-expert,
    per-channel fp32 scales in the tiles (FP8 MoE builds)."""
    from backend.ops import fused_moe_triton as m
    act = f"*{dtype}"
    types = {"a_ptr": act, "w_ptr": "*u8" if mxfp4 else "*fp8e4nv" if fp8 else act, "out_ptr": act,
             "sorted_ids_ptr": "*i32",
             "block_expert_ptr": "*i32", "num_padded_ptr": "*i32", "topk_w_ptr": "*fp32",
             "bias_ptr": act if gpt_oss else "*fp32", "w_scale_ptr": "*fp32" if fp8 else "*u8",
             **{n: "i32" for n in ("N", "K", "num_slots", "stride_am", "stride_we", "stride_wn", "stride_om",
                                   "stride_be", "stride_se", "stride_sn")}}
    return [compile_kernel(m._grouped_gemm_kernel, types,
                           dict(A_ROW_DIV=div, GATED=gated, MUL_WEIGHT=not gated, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=64,
                                IEEE=dtype == "fp32", HAS_BIAS=gpt_oss, SWIGLU_OAI=gpt_oss and gated, ALPHA=1.702,
                                LIMIT=7.0, MXFP4=mxfp4, FP8=fp8, SCALED_DOT=scaled_dot))
            for div, gated, bm in ((8, True, 16), (1, False, 64))] + [
        compile_kernel(m._route_kernel, {"logits_ptr": act, "weights_ptr": "*fp32", "ids_ptr": "*i64", "E": "i32",
                                         "stride_l": "i32"},
                       dict(TOP_K=8 if not gpt_oss else 4, BLOCK_K=8 if not gpt_oss else 4, RENORMALIZE=not gpt_oss,
                            BLOCK_E=128, SOFTMAX_AFTER_TOPK=gpt_oss))]


def decode_attention_with_sinks(dtype: str):
    """The one-token kernel with gpt-oss's sinks and window, split-KV (not the TensorRT
    plugin's entry, compiled with sinks by backend/attention/aot.py: tests/unit/attention/test_aot_ptx.py)."""
    from backend.attention import triton_attention as ta
    act = f"*{dtype}"
    types = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "k_cache_ptr": act, "v_cache_ptr": act,
             "slot_ptr": "*i64", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
             **{n: "i32" for n in ("num_seqs", "stride_bt", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                                   "stride_vt", "stride_vh", "stride_ot", "stride_oh")},
             "out_ptr": act, "k_cache_out_ptr": act, "v_cache_out_ptr": act, "part_acc_ptr": "*fp32",
             "part_ml_ptr": "*fp32", "sinks_ptr": act}
    consts = {**ta.attention_constexprs(64, 8, 64, 16, 0.125, 128, False, num_splits=4, sinks=True),
              "limits_ptr": None, "tree_ptr": None}
    return compile_kernel(ta._paged_attention_kernel, types, consts)


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile for a GPU target")
        return 2
    # bf16 (tensor cores) with and without an FP8 pool and a window, fp32 (IEEE dots).
    # The 4-token tile (16 rows with GQA 4) is the decode candidate benchmarks/attention_bench.py times.
    # Gemma 2: a window and the attention soft-cap.
    variants = [("bf16", False, 0), ("bf16", True, 4096), ("fp32", False, 0), ("bf16", False, 0, 4),
                ("bf16", False, 4096, 0, 50.0), ("bf16", False, 128, 0, 0.0, True)]
    ptx = {v: tiled_attention(*v).asm["ptx"] for v in variants}
    assert all(".target sm_90" in p for p in ptx.values())
    assert all(".target sm_90" in c.asm["ptx"] for c in layer_ops("bf16"))
    # The one-token (decode) kernel with Gemma 2's window and soft-cap, as the plugin's entry.
    from backend.attention.aot import compile_attention
    capped = compile_attention(fp8=False, sliding_window=4096, logits_soft_cap=50.0)
    assert ".target sm_90" in capped.ptx and capped.num_params == 25
    # Without sinks the node's sinks input (entry parameter 11) is never read.
    from backend.attention.aot import entry_params
    assert f"[{entry_params(capped.ptx, capped.name)[11]}]" not in capped.ptx
    int8_kv = int8_kv_attention("bf16")
    assert all(".target sm_90" in c.asm["ptx"] for c in int8_kv)
    if "mma" not in int8_kv[0].asm["ptx"]:
        print("the tiled kernel's bf16 tiles over an INT8 cache do not reach tensor cores")
        return 1
    extra = lora_and_int_gemm("bf16")
    assert all(".target sm_90" in c.asm["ptx"] for c in extra)
    if "mma" not in extra[-2].asm["ptx"]:
        print("the INT GEMM's dequantized bf16 tiles do not reach tensor cores")
        return 1
    blocked = int_gemm_blocked("bf16") + int_gemm_blocked("fp16")
    if not all(".target sm_90" in c.asm["ptx"] and "mma" in c.asm["ptx"] for c in blocked):
        print("the blocked INT GEMM's tiles do not reach tensor cores")
        return 1
    # The 4-bit codes become floats by the mantissa trick: no integer-to-float convert per weight.
    if any(re.search(r"cvt\.rn\.(f32|f16|bf16)\.[us]32", c.asm["ptx"]) for c in blocked[:2] + blocked[3:5]):
        print("the blocked INT4 GEMM converts its codes to floats instruction by instruction")
        return 1
    # Rounding as torch's: IEEE division (not div.full's 2 ulp), FP8 by the round-to-nearest-even convert.
    quant = [c.asm["ptx"] for c in quant_rows("bf16")]
    if not all("div.rn.f32" in p and "div.full" not in p for p in quant) \
            or not all("cvt.rn.satfinite.e4m3x2.f32" in p for p in quant[1:]):
        print("the activation quantizer does not round as torch does")
        return 1
    # Decode tiles (16 rows) use mma.sync ...s32.s8.s8.s32, 64-row tiles Hopper's wgmma ...s32.s8.s8.
    w8a8 = w8a8_gemm("bf16")
    if not all(".target sm_90" in c.asm["ptx"] and ".s32.s8.s8" in c.asm["ptx"] for c in w8a8) \
            or "wgmma.mma_async" not in w8a8[1].asm["ptx"]:
        print("the W8A8 GEMM's int8 tiles do not reach the INT8 tensor-core MMA")
        return 1
    # Block FP8: 64-row tiles on Hopper's FP8 wgmma (16-row decode tiles upcast to f16 MMAs).
    block = fp8_block_gemm("bf16")
    if not all(".target sm_90" in c.asm["ptx"] for c in block) or ".e4m3.e4m3" not in block[1].asm["ptx"]:
        print("the block FP8 GEMM's 64-row tiles do not reach the FP8 tensor-core MMA")
        return 1
    # gpt-oss: sinks in the one-token kernel (the tiled one is among the variants above).
    assert ".target sm_90" in decode_attention_with_sinks("bf16").asm["ptx"]
    assert all(".target sm_90" in c.asm["ptx"] for c in key_limits_attention("bf16"))
    moe = fused_moe("bf16") + fused_moe("bf16", gpt_oss=True) + fused_moe("bf16", gpt_oss=True, mxfp4=True) + \
        fused_moe("bf16", fp8=True) + fused_moe("bf16", gpt_oss=True, mxfp4=True, scaled_dot=True)
    assert all(".target sm_90" in c.asm["ptx"] for c in moe)
    if not all("mma" in c.asm["ptx"] for c in moe[:2] + moe[3:5] + moe[6:8] + moe[9:11] + moe[12:14]):
        print("the fused MoE grouped GEMM's bf16 tiles do not reach tensor cores")
        return 1
    # Tensor cores: the bf16 tiled kernel's PTX uses MMA instructions.
    mma = all("mma" in ptx[v] for v in [("bf16", False, 0), ("bf16", False, 4096, 0, 50.0),
                                        ("bf16", False, 128, 0, 0.0, True)])
    print("compiled for sm_90:", ", ".join(f"tiled_attention{v}" for v in variants),
          "+ INT8-KV attention, layer ops, LoRA SGMV, INT4/INT8/NF4 GEMM (gathering and blocked), the activation quantizer, W8A8 INT8 GEMM (int8 MMA), block FP8 "
          "GEMM (e4m3 wgmma) and fused MoE (bf16; gpt-oss's biased clamped SwiGLU, MXFP4 (decoded and by "
          "tl.dot_scaled) and FP8 tiles too)",
          "| bf16 tiles on tensor cores:", mma)
    return 0 if mma else 1


if __name__ == "__main__":
    sys.exit(main())
