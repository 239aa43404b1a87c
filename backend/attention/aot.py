"""Ahead-of-time compilation of the paged-attention kernel to PTX for a given NVIDIA
architecture, without a GPU: what the TensorRT plugin embeds in an engine
(backend/attention/trt_plugin.py), and what an offline kernel cache would ship.

    python -m backend.attention.aot --arch 90 --out build/ptx

The kernel is compiled with the argument order TensorRT's AOT plugins use: input
pointers in the node's input order, then int32 scalars, then output pointers. Must run
without TRITON_INTERPRET (kernels defined under the interpreter are not compilable).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from typing import Optional

PTR = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}

# The PagedAttention node's inputs, in order, and the kernel parameter each one feeds.
# `sinks` [num_heads] (gpt-oss's attention-sink logits; zeros, unread, for other models)
# comes last: the kernel takes it after its outputs, so the AOT entry moves it here.
NODE_INPUTS = ("q", "k", "v", "k_pool", "v_pool", "slot_mapping", "block_tables", "seq_lens",
               "query_start_loc", "k_scale", "v_scale", "sinks")
# int32 scalars after the inputs: the number of sequences and the row strides.
SCALAR_ARGS = ("num_seqs", "stride_bt", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
               "stride_vh", "stride_ot", "stride_oh")
NODE_OUTPUTS = ("out", "k_pool_out", "v_pool_out")


def plugin_scalar_args(num_heads, num_kv_heads: int, head_dim: int, num_seqs, max_blocks) -> list:
    """The int32 scalars, in SCALAR_ARGS order, for the node's contiguous tensors. Works on
    ints and on TensorRT's symbolic shape expressions alike (num_seqs and max_blocks are
    dynamic dimensions at build time)."""
    qt, kt = num_heads * head_dim, num_kv_heads * head_dim
    return [num_seqs, max_blocks, qt, head_dim, kt, head_dim, kt, head_dim, qt, head_dim]


@dataclass(frozen=True)
class CompiledKernel:
    name: str           # PTX entry point
    ptx: str
    num_warps: int
    shared: int         # bytes of dynamic shared memory
    num_params: int     # parameters of the PTX entry


def plugin_signature(dtype: str, fp8: bool) -> dict[str, str]:
    act, pool = PTR[dtype], ("*u8" if fp8 else PTR[dtype])
    ptrs = {"q_ptr": act, "k_ptr": act, "v_ptr": act, "k_cache_ptr": pool, "v_cache_ptr": pool,
            "slot_ptr": "*i64", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    scalars = {name: "i32" for name in SCALAR_ARGS}
    outs = {"out_ptr": act, "k_cache_out_ptr": pool, "v_cache_out_ptr": pool,
            # Split-KV partials are not used by a single-split launch: compiled away.
            "part_acc_ptr": "constexpr", "part_ml_ptr": "constexpr",
            # The node's last input, moved there in the PTX entry (compile_attention).
            "sinks_ptr": act}
    return {**ptrs, **scalars, **outs}


def compile_attention(arch: int = 90, dtype: str = "bf16", num_heads: int = 32, num_kv_heads: int = 8,
                      head_dim: int = 128, block_size: int = 16, scale: Optional[float] = None,
                      sliding_window: Optional[int] = None, fp8: bool = True,
                      logits_soft_cap: Optional[float] = None, sinks: bool = False) -> CompiledKernel:
    """sinks: the kernel reads the node's `sinks` input (HAS_SINKS); without, that input
    is in the entry but never read."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile kernels ahead of time")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from backend.attention import triton_attention as ta
    consts = ta.attention_constexprs(num_heads, num_kv_heads, head_dim, block_size,
                                     head_dim ** -0.5 if scale is None else scale, sliding_window, fp8,
                                     logits_soft_cap=logits_soft_cap, sinks=sinks)
    consts.update(part_acc_ptr=None, part_ml_ptr=None, limits_ptr=None, tree_ptr=None)     # (no key limits or trees in a graph)
    sig = {**plugin_signature(dtype, fp8), **{k: "constexpr" for k in consts}}
    compiled = triton.compile(ASTSource(fn=ta._paged_attention_kernel, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", arch, 32))
    md = compiled.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise RuntimeError("the kernel needs Triton scratch memory, which a TensorRT plugin cannot provide")
    visible = len(NODE_INPUTS) + len(SCALAR_ARGS) + len(NODE_OUTPUTS)
    ptx = drop_unused_params(compiled.asm["ptx"], md.name, keep=visible)
    # The kernel's sinks_ptr follows its outputs; TensorRT passes it with the inputs.
    ptx = move_param(ptx, md.name, visible - 1, len(NODE_INPUTS) - 1)
    return CompiledKernel(name=md.name, ptx=ptx, num_warps=md.num_warps, shared=md.shared,
                          num_params=len(entry_params(ptx, md.name)))


def entry_params(ptx: str, name: str) -> list[str]:
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise ValueError(f"entry {name} not found in PTX")
    return re.findall(r"\.param\s[^,]*?(\w+)\s*(?:,|$)", m.group(1).strip())


def drop_unused_params(ptx: str, name: str, keep: int) -> str:
    """Triton (>= 3.3) appends two hidden pointers (global and profile scratch) to every
    kernel; TensorRT launches an AOT plugin kernel with exactly its inputs, scalars and
    outputs. With no scratch in use the kernel never reads them, so the entry can drop
    them and match the launch TensorRT makes."""
    params = entry_params(ptx, name)
    extra = params[keep:]
    for p in extra:
        if re.search(r"\[" + re.escape(p) + r"\]", ptx):
            raise RuntimeError(f"kernel parameter {p} is read; cannot drop it")
    if not extra:
        return ptx
    m = re.search(r"(\.entry\s+" + re.escape(name) + r"\s*\()(.*?)(\))", ptx, re.S)
    lines = [ln for ln in m.group(2).split("\n") if not any(re.search(r"\b" + p + r"\b", ln) for p in extra)]
    body = "\n".join(lines).rstrip().rstrip(",") + "\n"
    return ptx[:m.start(2)] + body + ptx[m.end(2):]


def move_param(ptx: str, name: str, src: int, dst: int) -> str:
    """The entry's parameter declared at position src declared at dst instead. The body
    reads parameters by name, so this only changes which launch argument feeds it."""
    m = re.search(r"(\.entry\s+" + re.escape(name) + r"\s*\()(.*?)(\))", ptx, re.S)
    decls = [d.strip() for d in m.group(2).split(",")]
    decls.insert(dst, decls.pop(src))
    body = "\n" + ",\n".join("\t" + d for d in decls) + "\n"
    return ptx[:m.start(2)] + body + ptx[m.end(2):]


def assemble(ptx: str, arch: int, path: str) -> None:
    """ptxas (the one Triton ships) -> cubin at `path`: proves the edited PTX is valid."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    suffix = "a" if arch >= 90 else ""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        proc = subprocess.run([get_ptxas(arch).path, f"-arch=sm_{arch}{suffix}", f.name, "-o", path],
                              capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {proc.stderr[-2000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.attention.aot")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dtype", default="bf16", choices=sorted(PTR))
    ap.add_argument("--num-heads", type=int, default=32)
    ap.add_argument("--num-kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-fp8", action="store_true")
    ap.add_argument("--sinks", action="store_true", help="read the node's sinks input (gpt-oss)")
    ap.add_argument("--out", default="build/ptx")
    a = ap.parse_args(argv)
    k = compile_attention(a.arch, a.dtype, a.num_heads, a.num_kv_heads, a.head_dim, a.block_size,
                          fp8=not a.no_fp8, sinks=a.sinks)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"paged_attention.sm_{a.arch}.ptx")
    with open(path, "w") as f:
        f.write(k.ptx)
    assemble(k.ptx, a.arch, path[:-len(".ptx")] + ".cubin")
    print(f"{path}: entry {k.name}, {k.num_params} parameters, {k.num_warps} warps, "
          f"{k.shared} B shared, {len(k.ptx)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
