"""Our C++ CPU kernels: built with the system's compiler at first use, cached, loaded
with ctypes.

The sources (`backend/attention/cpu_decode.cpp`, `backend/ops/cpu_layer_ops.cpp`) are
plain C++ with a C ABI and no torch headers, so each compiles in about a second with
`g++` (or `$CXX`). A library is cached by its source, the compiler, the flags and the
CPU (it is built for this one, `-march=native`) under `$PAGED_LLM_CACHE_DIR` (default
`~/.cache/paged_llm`; where that cannot be written, a folder of this user's own in the
temporary folder). Processes that start together (Triton's model instances, test
servers) compile to temporary names and rename: none loads a half-written file.
Building a library removes that library's other versions (older sources, flags or CPUs)
not rebuilt for a week (`prune`).
ctypes.CDLL releases the GIL for each call, so threads (cpu_shards.py) run them side by
side. Where nothing compiles, or the library's switch is "0" in the environment,
`CppLibrary.get()` is None and the caller runs torch (a warning says why, once).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import platform
import stat
import subprocess
import tempfile
import threading
import time
from typing import Optional

import torch

log = logging.getLogger(__name__)

# -fno-trapping-math: loops with comparisons (max, min, selects) vectorize; without it
# GCC 12 kept the softmax's exp loop scalar (a compare may raise an FP exception flag,
# which nothing here reads). Values are unchanged: no reassociation, no contraction.
FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-pthread", "-fopenmp-simd", "-ffp-contract=off",
         "-fno-trapping-math"]
# Headers the sources include (`#include "cpu_vec.h"`): this folder, on the include path
# and in every library's cache key.
HEADER_DIR = os.path.dirname(os.path.abspath(__file__))
HEADERS = ("cpu_vec.h", "cpu_vec_x86.h", "cpu_attn_tiles.h", "cpu_threads.h")
CPU_FIELDS = ("model name", "flags", "Features", "CPU implementer", "CPU part")   # x86, then Arm's


def cpu_signature() -> str:
    """What a library's code depends on (-march=native): the CPU's model and
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


def cache_dir() -> str:
    """`$PAGED_LLM_CACHE_DIR`, else `~/.cache/paged_llm`; in the temporary folder where
    that cannot be written (a read-only home in a container)."""
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


# A library of an older source (or compiler, flags, CPU) is removed when a new one of the
# same name is built and it has not been rebuilt for this long: a process that still runs
# it keeps its mapping, and one that starts on that version again rebuilds it (a second).
STALE_AFTER_S = 7 * 24 * 3600


def prune(cache: str, name: str, keep: str, now: float | None = None) -> list[str]:
    """Removes `name`'s other libraries in `cache` older than STALE_AFTER_S; returns them."""
    now = time.time() if now is None else now
    removed = []
    for path in glob.glob(os.path.join(cache, f"{name}-*.so")):
        try:
            if path != keep and now - os.stat(path).st_mtime > STALE_AFTER_S:
                os.unlink(path)
                removed.append(path)
        except OSError:                 # another process removed it first
            pass
    return removed


def build(source_path: str, cxx: str) -> str:
    """The compiled library of `source_path`, compiled now if none is cached."""
    with open(source_path, "rb") as f:
        source = f.read()
    for header in HEADERS:            # a header's change rebuilds what includes it
        with open(os.path.join(HEADER_DIR, header), "rb") as f:
            source += f.read()
    name = os.path.splitext(os.path.basename(source_path))[0]
    cache = cache_dir()
    error = ""
    for march in (["-march=native"], []):
        flags = FLAGS + ["-I" + HEADER_DIR] + march
        key = source + " ".join([cxx, *flags]).encode() + cpu_signature().encode()
        path = os.path.join(cache, f"{name}-{hashlib.sha256(key).hexdigest()[:16]}.so")
        if os.path.exists(path):
            return path
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *flags, source_path, "-o", tmp], capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, path)
                prune(cache, name, keep=path)
                return path
            error = done.stderr.strip()[-500:]
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"{cxx} could not build {source_path}: {error}")


class CppLibrary:
    """One C++ source's library, loaded once per compiler. `signatures`: each exported
    function's (restype, argtypes); `env_switch`: the variable that, set to "0", keeps
    callers on their torch path; `what`: its name in the warning."""

    def __init__(self, source_path: str, env_switch: str, signatures: dict, what: str) -> None:
        self.source_path = source_path
        self.env_switch = env_switch
        self.signatures = signatures
        self.what = what
        self._lock = threading.Lock()
        self._loaded: dict[str, Optional[ctypes.CDLL]] = {}
        LIBRARIES.append(self)

    def get(self) -> Optional[ctypes.CDLL]:
        if os.environ.get(self.env_switch, "1") == "0":
            return None
        cxx = os.environ.get("CXX", "g++")
        lib = self._loaded.get(cxx, False)
        if lib is not False:
            return lib
        with self._lock:
            if cxx not in self._loaded:
                try:
                    lib = ctypes.CDLL(build(self.source_path, cxx))     # CDLL: the GIL is released during calls
                    for fn_name, (restype, argtypes) in self.signatures.items():
                        fn = getattr(lib, fn_name)
                        fn.restype, fn.argtypes = restype, argtypes
                    self._loaded[cxx] = lib
                except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as e:
                    log.warning("%s unavailable, using the torch path: %s", self.what, e)
                    self._loaded[cxx] = None
            return self._loaded[cxx]


LIBRARIES: list[CppLibrary] = []


def load_all() -> None:
    """Build (or load from the cache) every library defined so far: what an engine on
    the CPU does while it loads, so that its first step does not wait seconds for the
    compiler (a step that long trips the stall watchdog, engine_stall_timeout_s)."""
    for library in LIBRARIES:
        library.get()


def rows_f32(x: torch.Tensor) -> bool:
    """A CPU fp32 [T, N] tensor with unit inner stride: rows our C++ kernels walk by
    row stride."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1


def heads_dense(x: torch.Tensor) -> bool:
    """[T, heads, D] whose rows hold their heads D apart, each head contiguous (a view of
    a GEMM's output rows qualifies): the layout our C++ kernels walk by row stride."""
    return x.dim() == 3 and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]


def plain_tensors(*tensors: torch.Tensor) -> bool:
    """Whether these are real tensors in an eager call: a trace or export passes fake or
    functional tensor subclasses (no memory to hand a foreign function)."""
    return (all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
            and not torch.compiler.is_compiling())
