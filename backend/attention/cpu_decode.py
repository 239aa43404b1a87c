"""The CPU decode-attention kernel (cpu_decode.cpp): built with the system's C++ compiler
at first use, loaded with ctypes, and called once per layer for all of a step's decode
rows, reading K/V in place from the block pool.

Why: on the default model the torch path's decode attention (a gathered copy of each
sequence's blocks, then SDPA over it) was about half of a CPU step (docs/benchmarks.md
section 16); vLLM-CPU's C++ paged kernel reads the blocks where they lie, and so does
this one. The source is plain C++ with a C ABI (no torch headers), so it compiles in
about a second; the library is cached by source, flags and machine under
`$PAGED_LLM_CACHE_DIR` (default `~/.cache/paged_llm`). ctypes releases the GIL for the
call, so the forward's shard threads (cpu_shards.py) run it side by side.

Where no compiler works, or `PAGED_LLM_CPU_DECODE_KERNEL=0` is set, `kernel()` is None
and the torch path runs (a warning says why, once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import stat
import subprocess
import tempfile
import threading
from typing import Optional

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata

log = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_decode.cpp")
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", "-fopenmp-simd"]
DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ENV_SWITCH = "PAGED_LLM_CPU_DECODE_KERNEL"

_lock = threading.Lock()
_loaded: dict[str, Optional[ctypes.CDLL]] = {}


CPU_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU part")   # x86, then Arm's


def _cpu_signature() -> str:
    """What the library's code depends on (-march=native): the CPU's model and
    instruction-set flags (x86's `flags`, Arm's `Features` and part), first core's."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name = line.split(":", 1)[0].strip()
                if name in CPU_FIELDS and name not in fields:
                    fields[name] = line.strip()
    except OSError:
        pass
    return platform.machine() + "|".join(fields[k] for k in sorted(fields))


def _cache_dir() -> str:
    """`$PAGED_LLM_CACHE_DIR`, else `~/.cache/paged_llm`; the system's temporary folder
    where that cannot be written (a read-only home in a container)."""
    cache = os.environ.get("PAGED_LLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "paged_llm")
    try:
        os.makedirs(cache, exist_ok=True)
        if os.access(cache, os.W_OK):
            return cache
    except OSError:
        pass
    # The shared temporary folder: only a folder this user owns and nobody else may write
    # (another user could otherwise plant the library this process loads).
    cache = os.path.join(tempfile.gettempdir(), f"paged_llm-{os.getuid()}")
    try:
        os.makedirs(cache, mode=0o700, exist_ok=True)
        st = os.lstat(cache)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return cache
    except OSError:
        pass
    return tempfile.mkdtemp(prefix="paged_llm-")


def _build(cxx: str) -> str:
    """The compiled library's path, compiling it if this source, compiler and CPU have
    none cached yet. Compiled to a temporary name and renamed: processes that start
    together (Triton's model instances, test servers) never load a half-written file."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    cache = _cache_dir()
    for march in (["-march=native"], []):
        flags = FLAGS + march
        digest = hashlib.sha256(source + " ".join([cxx, *flags]).encode() + _cpu_signature().encode()).hexdigest()[:16]
        path = os.path.join(cache, f"cpu_decode-{digest}.so")
        if os.path.exists(path):
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *flags, SOURCE, "-o", tmp], capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, path)
                return path
            error = done.stderr.strip()[-500:]
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{cxx} could not build {SOURCE}: {error}")


def kernel() -> Optional[ctypes.CDLL]:
    """The loaded library, or None (torch path) when switched off or not buildable."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    cxx = os.environ.get("CXX", "g++")
    with _lock:
        if cxx not in _loaded:
            try:
                lib = ctypes.CDLL(_build(cxx))      # CDLL: the GIL is released during calls
                fn = lib.paged_decode
                fn.restype = ctypes.c_int
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                fn.argtypes = [ctypes.c_int, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64,
                               i64, i64, ctypes.c_float, ptr, i64, i64]
                _loaded[cxx] = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                log.warning("CPU decode-attention kernel unavailable, using the torch path: %s", e)
                _loaded[cxx] = None
        return _loaded[cxx]


class DecodePlan:
    """A step's decode sequences for the kernel, made once per step (the first layer's
    call) and read by every layer: their query rows, block-table rows and lengths."""

    def __init__(self, meta: AttentionMetadata) -> None:
        qsl = np.concatenate([[0], np.cumsum(meta.query_lens_cpu)])
        ids = np.flatnonzero(np.asarray(meta.query_lens_cpu) == 1)
        self.num_seqs = len(ids)
        self.rows = np.ascontiguousarray(qsl[ids], dtype=np.int64)
        self.seq_idx = ids.astype(np.int64)
        self.lens = np.asarray(meta.seq_lens_cpu, dtype=np.int64)[ids]
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        self.tables = tables           # kept alive with the plan: the kernel reads its memory


def decode_plan(meta: AttentionMetadata) -> DecodePlan:
    plans = meta.decode_plan
    if plans is None:
        plans = meta.decode_plan = {}
    plan = plans.get("cpu_kernel")
    if plan is None:
        plan = plans["cpu_kernel"] = DecodePlan(meta)
    return plan


def supports(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, logits_soft_cap, sinks) -> bool:
    """Whether the kernel can serve this layer: CPU tensors of one dtype it knows, no
    soft-cap or sinks (those run the explicit torch path), dense inner layouts, and a
    real call (not a trace, which cannot follow a foreign call)."""
    return (q.device.type == "cpu" and key.device.type == "cpu" and value.device.type == "cpu"
            and q.dtype in DTYPES and key.dtype == q.dtype and value.dtype == q.dtype
            and logits_soft_cap is None and sinks is None and q.stride(-1) == 1 and q.stride(-2) == q.shape[-1]
            and key.is_contiguous() and value.is_contiguous() and value.shape == key.shape
            and not torch.compiler.is_compiling())


def paged_decode(lib: ctypes.CDLL, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: DecodePlan,
                 scale: float, window: Optional[int], out: torch.Tensor) -> None:
    """out[rows] = attention of q[rows] over each decode sequence's cached K/V.
    q, out: [T, H, D]; key, value: [num_blocks, block_size, KVH, D]."""
    if plan.num_seqs == 0:
        return
    _, H, D = q.shape
    _, block_size, kvh, _ = key.shape
    tables = plan.tables
    rc = lib.paged_decode(
        DTYPES[q.dtype], q.data_ptr(), q.stride(0), key.data_ptr(), value.data_ptr(),
        tables.data_ptr(), tables.stride(0), plan.rows.ctypes.data, plan.seq_idx.ctypes.data,
        plan.lens.ctypes.data, plan.num_seqs, H, kvh, D, block_size, window or 0, scale,
        out.data_ptr(), out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged_decode failed (code {rc}) for H={H}, KVH={kvh}, D={D}, dtype={q.dtype}")
