"""Ahead-of-time compilation of the attention kernels to PTX/cubin for a given NVIDIA
architecture, without a GPU (what a TensorRT plugin or an offline cache would ship).

    python -m backend.attention.aot --arch 90 --out build/ptx

Must run without TRITON_INTERPRET (kernels defined under the interpreter are not
compilable).
"""

from __future__ import annotations

import argparse
import os
import sys

PTR = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def compile_kernels(arch: int = 90, dtype: str = "bf16", head_dim: int = 128, group: int = 4,
                    block_size: int = 16, fp8: bool = True) -> dict[str, dict[str, str]]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile kernels ahead of time")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backend.attention import triton_attention as ta
    cache = "*u8" if fp8 else PTR[dtype]
    attn_sig = {"q_ptr": PTR[dtype], "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": PTR[dtype],
                "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
                "query_start_loc_ptr": "*i32", "token_seq_ptr": "*i32", "k_scale": "fp32", "v_scale": "fp32",
                "sm_scale": "fp32", "stride_qt": "i32", "stride_qh": "i32", "stride_ot": "i32", "stride_oh": "i32",
                "stride_bt": "i32"}
    attn_consts = {"NUM_KV_HEADS": 8, "GROUP": group, "BLOCK_G": triton.next_power_of_2(group),
                   "HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "BLOCK_SIZE": block_size,
                   "SLIDING_WINDOW": 0, "FP8": fp8, "NUM_SPLITS": 1}
    write_sig = {"k_ptr": PTR[dtype], "v_ptr": PTR[dtype], "k_cache_ptr": cache, "v_cache_ptr": cache,
                 "slot_ptr": "*i64", "k_inv_scale": "fp32", "v_inv_scale": "fp32", "stride_kt": "i32",
                 "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32"}
    write_consts = {"NUM_KV_HEADS": 8, "HEAD_DIM": head_dim, "BLOCK_D": triton.next_power_of_2(head_dim), "FP8": fp8}
    target = GPUTarget("cuda", arch, 32)
    out = {}
    for name, fn, sig, consts in (("paged_attention", ta._paged_attention_kernel, attn_sig, attn_consts),
                                  ("write_kv", ta._write_kv_kernel, write_sig, write_consts)):
        sig = {**sig, **{k: "constexpr" for k in consts}}
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
        out[name] = {"ptx": compiled.asm["ptx"], "name": compiled.metadata.name}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.attention.aot")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=sorted(PTR))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--out", default="build/ptx")
    a = ap.parse_args(argv)
    kernels = compile_kernels(a.arch, a.dtype, a.head_dim, fp8=not a.no_fp8)
    os.makedirs(a.out, exist_ok=True)
    for name, k in kernels.items():
        path = os.path.join(a.out, f"{name}.sm_{a.arch}.ptx")
        with open(path, "w") as f:
            f.write(k["ptx"])
        print(f"{path}: entry {k['name']}, {len(k['ptx'])} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
