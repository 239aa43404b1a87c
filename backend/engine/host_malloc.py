"""glibc malloc's large blocks: kept for reuse by a CPU engine, given back at once by the frontend.

glibc serves an allocation above its mmap threshold (128 KiB, rising with use to at most
32 MiB) with a fresh mapping, and unmaps it when freed. torch's CPU allocator keeps
nothing, so a CPU forward maps its activations anew every step, and the kernel then
faults in every page on first touch. On this project's 2-core VMs that fault cost is
larger than the work: a 46 MB copy (the hidden-1024 Llama's gate/up output at 2,048
prompt tokens) took 13.6 ms freshly mapped and 1.7 ms from the heap; SiLU-and-mul over it
14.6 ms against 3.0 (docs/archive/benchmarks.md §16). vLLM-CPU's documentation preloads tcmalloc
for the same reason.

So a CPU engine sets, once per process:
- M_MMAP_MAX = 0: every block comes from the heap and goes back to it when freed, where
  the next step's same-sized activation finds it already faulted in;
- M_TRIM_THRESHOLD = 1 GiB: the top of the heap is given back to the system only when more
  than that lies free there (a closed engine's KV pool, say), not after every step.
The process's resident memory then stays near its peak: what a step freed waits for
the next step instead of going back to the system. Once a serving engine has been idle
for IDLE_TRIM_S (no request), `malloc_trim` gives the heaps' free memory back (IdleTrim):
a burst of large requests (a 15 MB prompt through Triton's `/generate`) leaves the
process where it was before it, and the next busy period faults its pages in once.

Threads other than the main one (the serving loop's, the forward's shard threads)
allocate from arenas of their own, whose heaps hold at most 64 MiB: a larger block there
is still mapped afresh (glibc maps it whatever M_MMAP_MAX says), and each arena keeps its
own freed memory. One arena for all threads (M_ARENA_MAX 1) would cover those blocks,
but the shard threads then queue on its lock for every allocation: the default model ran
3% slower (docs/archive/benchmarks.md §16). A preloaded tcmalloc has neither limit.

A process that holds little between requests (the OpenAI frontend) wants the opposite,
large blocks given back as soon as they are freed (map_large_blocks). glibc's default
does not quite do that: once the process frees a mapped block, glibc raises its mmap
threshold to that block's size (and the trim threshold to twice it), so a later, smaller
large block comes from the heap of the allocating thread's arena. Freed, it stays at the
top of that heap: free() trims only past the raised threshold, and malloc_trim gives
back the top of the main arena's heap alone. Ten 10 MB Responses requests left a worker
thread's arena of the frontend 20 MB larger, all of it free and still resident after
malloc_trim (2026-12-01). A threshold set with mallopt is fixed (glibc stops adjusting
both), so blocks from MAP_THRESHOLD_BYTES up are always mapped and unmapped.

Only where the C library is glibc, and not where the user chose otherwise: any
`MALLOC_*` setting or `glibc.malloc.` tunable in the environment, a preloaded allocator
(tcmalloc, jemalloc, mimalloc in `LD_PRELOAD`), or `PAGED_LLM_HOST_MALLOC=0`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import time
from typing import Callable, Optional

logger = logging.getLogger(__name__)

ENV_SWITCH = "PAGED_LLM_HOST_MALLOC"
# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 30
# map_large_blocks: a request's body, its JSON and the strings made from it are larger;
# the small objects of ordinary requests stay on the heaps, as before.
MAP_THRESHOLD_BYTES = 1 << 20

_applied = False


def user_chose_allocator(environ=os.environ) -> bool:
    """A setting of the user's that this must not override. (A preloaded OpenMP or other
    library is not one: only a preload that replaces malloc.)"""
    return (environ.get(ENV_SWITCH, "1") == "0" or "malloc" in environ.get("LD_PRELOAD", "")
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or any(k.startswith("MALLOC_") for k in environ))


def _mallopt() -> Optional[Callable[[int, int], int]]:
    """glibc's mallopt, or None where the user chose the allocator or the C library is not glibc."""
    if user_chose_allocator() or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def map_large_blocks() -> bool:
    """The frontend's policy above: blocks of MAP_THRESHOLD_BYTES and more mapped per
    allocation, and a heap's free top given back past 2 x that, both fixed whatever the
    process freed before (the trim threshold too: glibc may have raised it during start).
    True when it is in force. (Not for an engine's process: keep_large_blocks is its.)"""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    # (mallopt returns 1 on success)
    applied = mallopt(M_MMAP_THRESHOLD, MAP_THRESHOLD_BYTES) == 1 and \
        mallopt(M_TRIM_THRESHOLD, 2 * MAP_THRESHOLD_BYTES) == 1
    if not applied:
        logger.info("glibc's mallopt refused the frontend's memory policy: large blocks may stay resident")
    return applied


def keep_large_blocks() -> bool:
    """Applies the policy above (once per process); True when it is in force."""
    global _applied
    if _applied:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    _applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not _applied:
        logger.info("glibc's mallopt refused the host-memory policy: large blocks stay mapped per allocation")
    return _applied


IDLE_TRIM_S = 5.0


def release_free_memory() -> bool:
    """glibc's malloc_trim(0): every arena's free pages back to the system (the middle of
    a heap too, by madvise). False where the C library is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


class IdleTrim:
    """Calls `trim` every `after_s` while the engine stays idle, the first time `after_s`
    after its last work: `idle()` on every idle turn of the loop, `busy()` whenever it
    has work. (Idle, not only after engine work: a request refused before it reached the
    engine, a 15 MB prompt over the length limit, grew the process too.)"""

    def __init__(self, after_s: float = IDLE_TRIM_S, trim: Callable[[], bool] = release_free_memory,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s, self._trim, self._clock = after_s, trim, clock
        self._next: Optional[float] = None      # when idle() trims next

    def busy(self) -> None:
        self._next = None

    def idle(self) -> None:
        now = self._clock()
        if self._next is None:
            self._next = now + self.after_s
        elif now >= self._next:
            self._next = now + self.after_s
            self._trim()
