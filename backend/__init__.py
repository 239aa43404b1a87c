"""An in-flight batching LLM engine over a paged KV cache, and its Triton adapter.

Offline use:

    from backend import LLM, SamplingParams
    llm = LLM("path/to/hf_checkpoint", block_size=16, num_kv_blocks=512)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
"""

from backend.config import ConfigError, EngineArgs
from backend.engine.errors import DeadlineExceededError, EngineDeadError, InvalidRequestError, QueueFullError
from backend.engine.outputs import RequestOutput
from backend.llm import LLM
from backend.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "ConfigError", "SamplingParamsError",
           "InvalidRequestError", "QueueFullError", "EngineDeadError", "DeadlineExceededError"]
