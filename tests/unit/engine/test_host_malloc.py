"""host_malloc.py: large host blocks come from glibc's heap, and a user's own choice wins."""

import os
import platform
import subprocess
import sys

import pytest

from backend.engine.host_malloc import user_chose_allocator

GLIBC = platform.libc_ver()[0] == "glibc"

# In a fresh process: how many more blocks malloc holds as separate mappings (mallinfo2's
# hblks) while a 64 MiB tensor lives, and how many of its bytes lie in the heap (arena)
# after it is freed, kept for the next one.
PROBE = r"""
import ctypes, sys
sys.path.insert(0, {root!r})
from backend.engine.host_malloc import keep_large_blocks
applied = keep_large_blocks() if {apply} else False
import torch
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblks
x = torch.empty(16 << 20, dtype=torch.float32)
mapped = libc.mallinfo2().hblks - before
del x
print(applied, mapped, libc.mallinfo2().fordblks >= 64 << 20)
"""


def _probe(apply: bool, **env) -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(root=root, apply=apply)], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return out.split()


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's mallopt")
def test_large_blocks_come_from_the_heap_once_applied():
    applied, mapped, kept = _probe(True)
    assert applied == "True" and mapped == "0" and kept == "True"
    # glibc's default (the case this fixes): the 64 MiB block is a mapping of its own,
    # unmapped when freed.
    applied, mapped, kept = _probe(False)
    assert applied == "False" and mapped == "1" and kept == "False"


@pytest.mark.skipif(not GLIBC, reason="the policy is glibc's mallopt")
def test_switch_leaves_glibc_defaults():
    applied, mapped, _ = _probe(True, PAGED_LLM_HOST_MALLOC="0")
    assert applied == "False" and mapped == "1"


def test_user_choices_win():
    assert not user_chose_allocator({})
    assert not user_chose_allocator({"PAGED_LLM_HOST_MALLOC": "1", "LD_PRELOAD": " "})
    assert user_chose_allocator({"PAGED_LLM_HOST_MALLOC": "0"})
    assert user_chose_allocator({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"})
    assert user_chose_allocator({"MALLOC_ARENA_MAX": "2"})
