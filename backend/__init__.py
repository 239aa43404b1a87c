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

from backend.config import ConfigError, EngineArgs  # noqa: E402
from backend.engine.errors import DeadlineExceededError, EngineDeadError, InvalidRequestError, QueueFullError  # noqa: E402
from backend.engine.outputs import RequestOutput  # noqa: E402
from backend.llm import LLM  # noqa: E402
from backend.sampling_params import SamplingParams, SamplingParamsError  # noqa: E402

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "ConfigError", "SamplingParamsError",
           "InvalidRequestError", "QueueFullError", "EngineDeadError", "DeadlineExceededError"]
