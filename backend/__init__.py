"""An in-flight batching LLM engine over a paged KV cache, and its Triton adapter.

Offline use:

    from backend import LLM, SamplingParams
    llm = LLM("path/to/hf_checkpoint", block_size=16, num_kv_blocks=512)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
"""

import os as _os
import sys as _sys

# torch's CPU threads run on libgomp, which reads OMP_WAIT_POLICY once, when torch loads.
# Its default spins at every barrier: when another process shares a core, the spinning
# threads are time-sliced with it and throughput collapses (2,413 to 88 tok/s on 2 cores:
# docs/archive/benchmarks.md §16). PASSIVE threads sleep between parallel regions. A user's own
# setting wins; it must be in place before the first `import torch`.
#
# THP_MEM_ALLOC_ENABLE (read by torch's CPU allocator at its first allocation): tensors
# of 2 MiB and more are advised to transparent huge pages (madvise), which is where the
# kernel's THP setting `madvise` (the CI machines) gives them. A decode step reads every sequence's
# K/V blocks scattered over the pool and streams every weight: with 4 KiB pages each 32
# KiB block spans 8 TLB entries. Measured: the CPU decode-attention kernel 4-9% faster,
# the hidden-1024 Llama's offline run 2-7% (docs/archive/benchmarks.md §16).
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

# The names below load on first use (PEP 562): a process that needs one small module of
# the package (the HTTP guard, the launcher) does not import torch and pydantic with it.
_EXPORTS = {
    "ConfigError": "backend.config", "EngineArgs": "backend.config",
    "DeadlineExceededError": "backend.engine.errors", "EngineDeadError": "backend.engine.errors",
    "InvalidRequestError": "backend.engine.errors", "QueueFullError": "backend.engine.errors",
    "RequestOutput": "backend.engine.outputs", "LLM": "backend.llm",
    "SamplingParams": "backend.sampling_params", "SamplingParamsError": "backend.sampling_params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'backend' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
