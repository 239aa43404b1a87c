"""host_malloc.py: large host blocks come from glibc's heap, and a user's own choice wins."""

import os
import platform
import subprocess
import sys

import pytest

from backend.engine.host_malloc import user_chose_allocator

GLIBC = platform.libc_ver()[0] == "glibc"

# In a fresh process, on the main thread (100 MiB) and then on another (48 MiB: its own
# arena's heaps hold at most 64 MiB): how many more blocks malloc holds as separate
# mappings (mallinfo2's hblks) while the tensor lives, and whether its bytes lie free in
# a heap after it is freed, kept for the next one.
PROBE = r"""
import ctypes, sys, threading
sys.path.insert(0, {root!r})
from backend.engine.host_malloc import keep_large_blocks
applied = keep_large_blocks() if {apply} else False
import torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
def probe(found, mib):
    before = libc.mallinfo2().hblks
    x = torch.empty(mib << 18, dtype=torch.float32)
    found["mapped"] = libc.mallinfo2().hblks - before
    del x
    found["kept"] = libc.mallinfo2().fordblks >= mib << 20
main, other = {{}}, {{}}
probe(main, 100)
t = threading.Thread(target=probe, args=(other, 48))       # a thread's arena: heaps of at most 64 MiB
t.start(); t.join()
print(applied, main["mapped"], main["kept"], other["mapped"], other["kept"])
"""


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _in_fresh_process(script: str, **env) -> list[str]:
    """The words `script` prints, run by a new interpreter (glibc's malloc state as at
    start) without the user's malloc settings (MALLOC_*, LD_PRELOAD), with `env` added."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    return subprocess.run([sys.executable, "-c", script], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, check=True).stdout.split()


def _probe(apply: bool, **env) -> list[str]:
    return _in_fresh_process(PROBE.format(root=ROOT, apply=apply), **env)


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's mallopt")
def test_large_blocks_come_from_the_heap_once_applied():
    assert _probe(True) == ["True", "0", "True", "0", "True"]
    # glibc's default (the case this fixes): the block is a mapping of its own, unmapped
    # when freed, on either thread.
    assert _probe(False) == ["False", "1", "False", "1", "False"]


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's mallopt")
def test_switch_leaves_glibc_defaults():
    assert _probe(True, PAGED_LLM_HOST_MALLOC="0")[:2] == ["False", "1"]


def test_user_choices_win():
    assert not user_chose_allocator({})
    assert not user_chose_allocator({"PAGED_LLM_HOST_MALLOC": "1", "LD_PRELOAD": " "})
    # A preloaded OpenMP runtime (as Intel's and vLLM's CPU guides advise) is not an allocator.
    assert not user_chose_allocator({"LD_PRELOAD": "/opt/intel/lib/libiomp5.so"})
    assert not user_chose_allocator({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"})
    assert user_chose_allocator({"PAGED_LLM_HOST_MALLOC": "0"})
    assert user_chose_allocator({"LD_PRELOAD": "/usr/lib/libiomp5.so:/usr/lib/libtcmalloc_minimal.so.4"})
    assert user_chose_allocator({"LD_PRELOAD": "libjemalloc.so.2"})
    assert user_chose_allocator({"MALLOC_ARENA_MAX": "2"})
    assert user_chose_allocator({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"})


def test_a_cpu_engine_applies_the_policy(monkeypatch, tmp_path):
    """The engine's assembly calls it for a CPU engine (the policy itself: above)."""
    import backend.engine.assembly as assembly
    from backend import LLM
    from tests.helpers.checkpoints import make_checkpoint
    calls = []
    monkeypatch.setattr(assembly, "keep_large_blocks", lambda: calls.append(1) or True)
    LLM(make_checkpoint(str(tmp_path)), device="cpu", num_kv_blocks=16, block_size=16)
    assert calls == [1]


def test_idle_trim_runs_after_a_quiet_spell_and_again_while_it_lasts():
    from backend.engine.host_malloc import IdleTrim
    now, calls = [0.0], []
    trim = IdleTrim(after_s=5.0, trim=lambda: calls.append(now[0]) or True, clock=lambda: now[0])
    for t in (0.0, 1.0, 4.9):
        now[0] = t
        trim.idle()
    assert calls == []
    now[0] = 5.0
    trim.idle()
    now[0] = 6.0
    trim.busy()                             # work: the quiet spell starts over
    for t in (7.0, 11.9, 12.0, 13.0, 17.0):
        now[0] = t
        trim.idle()
    assert calls == [5.0, 12.0, 17.0]


TRIM = r"""
import sys
sys.path.insert(0, {root!r})
from backend.engine.host_malloc import keep_large_blocks, release_free_memory
import torch
keep_large_blocks()
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
blocks = [torch.ones(25_000_000) for _ in range(4)]     # 400 MB, faulted in
del blocks
held = rss()
release_free_memory()
print(held, rss())
"""


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc_trim")
def test_release_gives_the_free_heap_back():
    """Under the engine's policy a freed 400 MB stays resident (kept for the next step);
    malloc_trim gives it back."""
    held, after = map(int, _in_fresh_process(TRIM.format(root=ROOT))[-2:])
    assert held - after > 300, (held, after)


# In a fresh process: a worker thread frees a 20 MiB block (mapped: glibc then raises its
# thresholds to 20 MiB and 40 MiB), then allocates and frees 15 MiB, which the raised
# threshold puts on the thread's own arena's heap. The anonymous resident memory before
# and after, malloc_trim done.
ARENA_TOP = r"""
import sys, threading
sys.path.insert(0, {root!r})
from backend.engine.host_malloc import map_large_blocks, release_free_memory
applied = map_large_blocks() if {apply} else False
def anon_mib():
    return int(open("/proc/self/status").read().split("RssAnon:")[1].split()[0]) // 1024
def request():
    body = bytearray(20 << 20); del body
    body = bytearray(15 << 20); del body
before = anon_mib()
t = threading.Thread(target=request)
t.start(); t.join()
release_free_memory()
print(applied, anon_mib() - before)
"""


def _arena_top(apply: bool) -> tuple[bool, int]:
    applied, grown = _in_fresh_process(ARENA_TOP.format(root=ROOT, apply=apply))
    return applied == "True", int(grown)


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's mallopt")
def test_the_frontends_policy_gives_a_threads_large_blocks_back():
    """What a worker thread of the frontend freed goes back to the system at once, even after
    the process freed a larger block (glibc's raised threshold would keep it resident,
    malloc_trim or not: the case this fixes)."""
    applied, grown = _arena_top(True)
    assert applied and grown < 4, grown
    applied, grown = _arena_top(False)
    assert not applied and grown >= 10, grown          # glibc's default keeps it
