"""Engine arguments, validated once at load.

Names follow vLLM's engine arguments so that operators can carry their settings over.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A bad engine argument; the message names the field."""


def json_or_value(v: Any) -> Any:
    """A nested setting given as JSON text (config.pbtxt, the command line) or as a value."""
    if isinstance(v, str):
        try:
            return json.loads(v) if v.strip() else None
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e.msg} (column {e.colno})") from None
    return v


class SpeculativeConfig(BaseModel):
    """vLLM's `speculative_config`: who proposes tokens for the target to verify
    (backend/engine/spec_decode/). n-gram: prompt lookup over the request's own tokens;
    draft_model: a smaller checkpoint with the target's tokenizer; eagle3 / eagle: an
    EAGLE-3 / EAGLE-1 head that drafts from the target's hidden states; medusa: Medusa
    heads on the target's final hidden state (each in its published checkpoint layout)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "medusa"]
    # Proposals per verification: a chain's length, or a tree's node count.
    num_speculative_tokens: int = Field(ge=1, le=63)
    # n-gram: the longest and shortest suffix of the request's tokens looked up earlier in
    # it. vLLM's defaults: 5 and 5; one given, the other equals it.
    prompt_lookup_min: Optional[int] = Field(None, ge=1)
    prompt_lookup_max: Optional[int] = Field(None, ge=1)
    # draft_model / eagle3 / medusa: the draft's (or the heads') checkpoint folder.
    model: Optional[str] = None
    # vLLM's tree of proposals (eagle, eagle3, medusa): paths of child ranks such as
    # "[(0,), (1,), (0, 0)]" (backend/engine/spec_decode/token_tree.py); its node count is
    # num_speculative_tokens. None: a chain.
    speculative_token_tree: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _vllm_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "method" not in data and data.get("model"):
            # vLLM infers the method when only a model is named.
            ngram = data["model"] == "[ngram]"
            data = {**data, "method": "ngram" if ngram else "draft_model", **({"model": None} if ngram else {})}
        tree = data.get("speculative_token_tree")
        if tree is not None and not isinstance(tree, str):
            try:
                data = {**data, "speculative_token_tree": str([tuple(p) for p in tree])}  # (a list, as JSON gives it)
            except TypeError:
                data = {**data, "speculative_token_tree": str(tree)}     # (the check below names the error)
        if data.get("speculative_token_tree") is not None and data.get("num_speculative_tokens") is None:
            from backend.engine.spec_decode.token_tree import TreeError, parse_tree
            try:
                data = {**data, "num_speculative_tokens": len(parse_tree(data["speculative_token_tree"]))}
            except TreeError:
                data = {**data, "num_speculative_tokens": 1}     # (the check below names the error)
        if data.get("method") == "ngram":
            lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
            data = {**data, "prompt_lookup_min": lo or hi or 5, "prompt_lookup_max": hi or lo or 5}
        return data

    @property
    def has_draft_cache(self) -> bool:
        """The proposer is a network with K/V of its own in the target's blocks."""
        return self.method in ("draft_model", "eagle", "eagle3")

    @property
    def reads_target_hidden(self) -> bool:
        """The proposer drafts from the target's hidden states (EAGLE, Medusa), which the
        target's forward captures for the whole step."""
        return self.method in ("eagle", "eagle3", "medusa")

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeConfig":
        if self.method == "ngram" and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method != "ngram" and not self.model:
            raise ValueError(f"method '{self.method}' needs 'model' (the draft checkpoint folder)")
        if self.method == "ngram" and self.model:
            raise ValueError("method 'ngram' takes no 'model'")
        if self.speculative_token_tree is None:
            if self.num_speculative_tokens > 16:
                raise ValueError(f"num_speculative_tokens {self.num_speculative_tokens}: a chain has at most 16")
            return self
        from backend.engine.spec_decode.token_tree import TreeError, parse_tree
        if self.method not in ("eagle", "eagle3", "medusa"):
            raise ValueError(f"speculative_token_tree needs method 'eagle', 'eagle3' or 'medusa', not '{self.method}'")
        try:
            n = len(parse_tree(self.speculative_token_tree))
        except TreeError as e:
            raise ValueError(f"speculative_token_tree: {e}") from None
        if n != self.num_speculative_tokens:
            raise ValueError(f"speculative_token_tree has {n} nodes; num_speculative_tokens is "
                             f"{self.num_speculative_tokens} (it counts the tree's nodes, as in vLLM)")
        if self.token_tree is None and n > 16:
            raise ValueError(f"speculative_token_tree is a chain of {n} proposals: a chain has at most 16")
        return self

    @property
    def token_tree(self):
        """The tree of proposals (token_tree.TokenTree), or None for a chain (a tree whose
        every node is a first choice is one)."""
        if self.speculative_token_tree is None:
            return None
        from backend.engine.spec_decode.token_tree import TokenTree
        tree = TokenTree.parse(self.speculative_token_tree)
        return None if tree.is_chain else tree


class PoolerConfig(BaseModel):
    """vLLM's `pooler_config` for `runner: pooling` (backend/engine/runner/pooling_runner.py):
    how a prompt's final hidden states (after the final norm) become one vector. LAST:
    the last token's (Qwen3-Embedding and other decoder embedding models); MEAN: the
    average over every prompt token. `normalize`: L2 to unit length (cosine-ready)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    pooling_type: Literal["LAST", "MEAN"] = "LAST"
    normalize: bool = True

    @field_validator("pooling_type", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v


class KVEventsConfig(BaseModel):
    """vLLM's `kv_events_config`: KV cache events (block stored, removed, all cleared)
    published over ZMQ for KV-aware routers (backend/engine/kv_events/)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["zmq", "null"] = "zmq"
    # On this machine only: a loopback address or ipc:// (the events carry token ids, and
    # a ZMQ port takes no key). vLLM's default binds every interface.
    endpoint: str = "tcp://127.0.0.1:5557"
    topic: str = ""
    hwm: int = Field(100_000, ge=1)
    max_queue_size: int = Field(100_000, ge=1)
    # A ROUTER socket that sends a subscriber the batches it missed (vLLM's), and how many
    # batches it keeps for that.
    replay_endpoint: Optional[str] = None
    buffer_steps: int = Field(10_000, ge=1)
    # Ours: block hashes as vLLM sends them by default, 64-bit ints (the last 8 bytes of
    # our SHA-256; what Dynamo's listener reads), or the whole 32 bytes.
    block_hash_format: Literal["int", "bytes"] = "int"

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _on_this_machine(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        host = v[len("tcp://"):].rsplit(":", 1)[0].strip("[]") if v.startswith("tcp://") else None
        if not (v.startswith("ipc://") or host in ("127.0.0.1", "localhost", "::1")):
            raise ValueError(f"'{v}' is not on this machine: KV events carry prompts' token ids and a ZMQ port "
                             "takes no key, so the endpoint must be tcp://127.0.0.1:PORT, tcp://[::1]:PORT or "
                             "ipc://PATH (relay to other machines through Dynamo's publisher)")
        return v


def lora_modules_value(v: Any) -> Any:
    """vLLM's `lora_modules`: {name: folder}, as JSON text, as `name=folder` items (its
    command line), or as a list of {"name", "path"} objects (its JSON form)."""
    v = json_or_value(v) if isinstance(v, str) and v.strip()[:1] in "{[" else v
    if isinstance(v, str):
        v = [item for item in v.replace(",", " ").split() if item]
    if isinstance(v, list):
        out = {}
        for item in v:
            if isinstance(item, dict):
                out[item.get("name")] = item.get("path")
            elif isinstance(item, str) and "=" in item:
                name, path = item.split("=", 1)
                out[name] = path
            else:
                raise ValueError(f"{item!r} is neither name=folder nor {{\"name\": ..., \"path\": ...}}")
        return out
    return v


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="Path to a local Hugging Face checkpoint folder.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    block_size: int = Field(16, ge=1, le=1024)
    num_kv_blocks: Optional[int] = Field(None, ge=1)
    # Used only when num_kv_blocks is unset: bytes of KV cache to allocate. On CUDA the
    # default is what gpu_memory_utilization (a fraction of the device's total memory)
    # leaves after the model and a profile run (backend/engine/sizing.py).
    kv_cache_memory_bytes: Optional[int] = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    max_model_len: Optional[int] = Field(None, ge=1)
    enable_prefix_caching: bool = True
    # vLLM's: GiB of host memory for a KV tier below the device pool
    # (backend/engine/kv_offload/): every computed full block is kept there too, and a
    # prefix that runs past the pool's hits continues from it instead of recomputing.
    kv_offloading_size: Optional[float] = Field(None, gt=0)
    max_queue_size: Optional[int] = Field(None, ge=0)
    # vLLM's: "fcfs" admits requests in arrival order; "priority" by each request's
    # `priority` (lower first, then arrival), and preempts lower priorities first
    # (backend/engine/scheduling/priority.py).
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # Ours (vLLM has no aging): under scheduling_policy priority, a request's priority
    # improves by one level per this many seconds since it arrived, so lower priorities
    # are not starved by a steady stream of higher ones. Unset: no aging.
    priority_aging_s: Optional[float] = Field(None, gt=0)
    # Ours: under scheduling_policy priority, prompt tokens a step gives at most to
    # requests ranked below the best-ranked one present (shorter steps while
    # better-ranked work is around). Unset: no cap.
    lower_priority_prefill_tokens: Optional[int] = Field(None, ge=1)
    seed: int = 0
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = "auto"
    # INT8 cache: a safetensors file of per-KV-head scales (vLLM's tensor names,
    # model.layers.N.self_attn.k_scale / v_scale, [num_kv_heads] each), calibrated by
    # `python -m builder build --kv-cache int8` (backend/engine/runner/kv_int8.py).
    kv_cache_scales: Optional[str] = None
    # What runs the forward pass: the torch model, or an exported graph (model_graph):
    # an ONNX reference export in onnxruntime (CPU check of the export), or a TensorRT
    # engine built from the plugin export.
    model_runner: Literal["torch", "onnxruntime", "tensorrt"] = "torch"
    model_graph: Optional[str] = None
    # vLLM's name: true runs every step eagerly. Otherwise, on CUDA with the Triton
    # kernels, decode-only steps replay CUDA graphs captured at load.
    enforce_eager: bool = False
    # vLLM's name: ranks the model is split over (Megatron-style; backend/parallel/).
    # Rank 0 is the engine's process, the others are processes it starts: one device
    # each on CUDA, gloo between processes on CPU.
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # vLLM's name: the layers split into this many stages of tensor_parallel_size ranks
    # each (backend/parallel/pipeline.py).
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    # vLLM's name (its config's): micro-batches in flight at once under pipeline
    # parallelism (backend/engine/scheduling/batch_queue.py), each a disjoint set of requests. None:
    # pipeline_parallel_size, as vLLM; 1: one batch at a time (P-1 stages idle).
    max_concurrent_batches: Optional[int] = Field(None, ge=1, le=64)
    # vLLM's names: the ranks spread over nnodes machines. This process is the head
    # (node 0); the others run `python -m backend.parallel.node` and meet it through the
    # TCP store it serves at master_addr:master_port (default: MASTER_ADDR, MASTER_PORT,
    # else 29500). A node that has not joined in node_join_timeout_s fails the load; one
    # whose heartbeats stop for node_health_timeout_s fails the model.
    nnodes: int = Field(1, ge=1, le=1024)
    master_addr: Optional[str] = None
    master_port: Optional[int] = Field(None, ge=1, le=65535)
    node_join_timeout_s: float = Field(600.0, gt=0.0)
    node_health_timeout_s: float = Field(10.0, gt=0.0)
    # vLLM's name: a MoE model's experts placed whole on the ranks (E / tp each) instead
    # of every expert sliced over them (backend/parallel/moe_sharding.py). Dense models
    # ignore it.
    enable_expert_parallel: bool = False
    # vLLM's name: speculative decoding (a JSON object in config.pbtxt and model.json).
    speculative_config: Optional[SpeculativeConfig] = None
    # vLLM's: KV cache events over ZMQ (KVEventsConfig), as JSON text or a dict.
    kv_events_config: Optional[KVEventsConfig] = None
    # vLLM's name: schedule step N+1 while the device runs step N (its sampled ids feed
    # step N+1 on the device; stops are seen one step behind). None: on wherever output
    # stays exact, which is everywhere (speculation included: a speculating request sits
    # out the step launched while its own is in flight) except tensor and pipeline
    # parallelism (the ranks would need step N's ids) and the exported-graph runners.
    async_scheduling: Optional[bool] = None
    # The CPU forward split by sequences into this many shards, each run on its own thread
    # with the intra-op threads divided between them (backend/engine/runner/cpu_shards.py): small
    # models' ops are too small to share between intra-op threads. None: 2 on CPU with the
    # torch model, one rank, no LoRA, at least 2 intra-op threads and weights that fit in
    # the last-level cache; 1: off.
    cpu_forward_shards: Optional[int] = Field(None, ge=1, le=64)
    # vLLM's names: "pooling" serves an embedding model (`vllm serve --runner pooling`):
    # every request is a prompt whose pooled final hidden state is the result, computed
    # in prefill steps (chunked like any prompt) with no token sampled.
    runner: Literal["generate", "pooling"] = "generate"
    pooler_config: Optional[PoolerConfig] = None

    # Multi-LoRA (vLLM's names; backend/lora/): adapters by name (PEFT folders), how many
    # are resident on the device at once (slots, LRU), the largest rank they may have, and
    # how many stay loaded in host memory. Adapters given make enable_lora true.
    enable_lora: bool = False
    lora_modules: dict[str, str] = Field(default_factory=dict)
    max_loras: int = Field(1, ge=1, le=256)
    max_lora_rank: int = Field(16, ge=1, le=512)
    max_cpu_loras: Optional[int] = Field(None, ge=1)

    # Vision-language models (backend/multimodal/): vLLM's limit_mm_per_prompt (items per
    # prompt by modality; {"image": 0} refuses images), its encoder budget per step and
    # encoder cache size (both in vision-tower output rows; None: max_num_batched_tokens,
    # raised to the largest image the processor makes), and ours: the largest encoded
    # image accepted and its largest pixel count (read from the header before decoding).
    limit_mm_per_prompt: dict[str, int] = Field(default_factory=lambda: {"image": 16})
    max_num_encoder_input_tokens: Optional[int] = Field(None, ge=1)
    encoder_cache_size: Optional[int] = Field(None, ge=1)
    max_image_bytes: int = Field(20 * 1024 * 1024, ge=1)
    max_image_pixels: int = Field(64 * 1024 * 1024, ge=1)

    # Per-request limits (backend/engine/request_limits.py): a request over one is refused
    # alone, with an error naming the field and the limit; the server serves on. vLLM's
    # names and defaults where it has them (max_logprobs).
    max_n: int = Field(64, ge=1)
    max_logprobs: int = Field(20, ge=0)
    max_stop_strings: int = Field(16, ge=0)
    max_stop_string_len: int = Field(512, ge=1)          # characters, per stop string
    max_stop_token_ids: int = Field(64, ge=0)
    # Structured output: the spec's size (guided_json as compact JSON, guided_regex,
    # guided_choice, guided_grammar; UTF-8 bytes), and how long its grammar may take to
    # compile before the request fails (a pathological schema compiles for minutes).
    max_guided_spec_bytes: int = Field(65536, ge=1)
    guided_compile_timeout_s: float = Field(10.0, gt=0.0)
    # Server-side deadline from arrival: a request still unfinished then is aborted with
    # an error. None: no deadline. A request may set a shorter one (sampling parameter
    # request_timeout_s), never a longer one.
    request_timeout_s: Optional[float] = Field(None, gt=0.0)

    _speculative_json = field_validator("speculative_config", mode="before")(lambda v: json_or_value(v))
    _kv_events_json = field_validator("kv_events_config", mode="before")(lambda v: json_or_value(v))
    _pooler_json = field_validator("pooler_config", mode="before")(lambda v: json_or_value(v))
    _lora_modules = field_validator("lora_modules", mode="before")(lambda v: lora_modules_value(v))
    _mm_limit_json = field_validator("limit_mm_per_prompt", mode="before")(lambda v: json_or_value(v))

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _mm_limits(cls, v: dict[str, int]) -> dict[str, int]:
        unknown = sorted(set(v) - {"image"})
        if unknown:
            raise ValueError(f"modality '{unknown[0]}' is not served (supported: image)")
        if any(n < 0 for n in v.values()):
            raise ValueError("limits must be 0 or more")
        return v

    @field_validator("guided_compile_timeout_s", "request_timeout_s", "node_join_timeout_s", "node_health_timeout_s")
    @classmethod
    def _finite_seconds(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number of seconds")
        return v

    @model_validator(mode="before")
    @classmethod
    def _lora_implied(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("lora_modules") and "enable_lora" not in data:
            data = {**data, "enable_lora": True}
        return data

    @model_validator(mode="after")
    def _check_runner(self) -> "EngineArgs":
        if self.model_runner != "torch" and not self.model_graph:
            raise ValueError(f"model_graph (the exported graph's path) is required with "
                             f"model_runner='{self.model_runner}'")
        if self.model_runner == "onnxruntime" and (self.kv_cache_dtype != "auto" or self.device == "cuda"):
            raise ValueError("model_runner='onnxruntime' runs the fp32 reference export on CPU: "
                             "it takes neither kv_cache_dtype='fp8' nor device='cuda'")
        if (self.kv_cache_dtype == "int8") != (self.kv_cache_scales is not None):
            raise ValueError("kv_cache_dtype='int8' needs kv_cache_scales (per-head scales calibrated by "
                             "`python -m builder build --kv-cache int8`), and kv_cache_scales is only for it")
        if self.kv_cache_dtype == "int8" and (self.model_runner != "torch" or (
                self.speculative_config is not None and self.speculative_config.has_draft_cache)):
            raise ValueError("kv_cache_dtype='int8' needs model_runner='torch' and no draft model (the exported "
                             "graphs and a draft's cache have no per-head scales)")
        if self.tensor_parallel_size > 1 and self.model_runner != "torch":
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} needs model_runner='torch' "
                             "(the exported graphs are single-device)")
        self._check_pipeline()
        if self.speculative_config is not None and self.model_runner != "torch":
            raise ValueError("speculative_config needs model_runner='torch' (the exported graphs return one "
                             "row of logits per sequence)")
        if (self.speculative_config is not None and self.speculative_config.method != "ngram"
                and self.tensor_parallel_size > 1):
            raise ValueError(f"speculative_config with method '{self.speculative_config.method}' runs on one rank: "
                             "use tensor_parallel_size=1, or method 'ngram'")
        if self.enable_lora:
            if self.model_runner != "torch":
                raise ValueError("enable_lora needs model_runner='torch' (the adapters' deltas run in the torch "
                                 "model)")
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
            bad = [n for n, p in self.lora_modules.items() if not n or not isinstance(p, str) or not p]
            if bad:
                raise ValueError(f"lora_modules: adapter {bad[0]!r} needs a name and a folder")
        if self.async_scheduling:
            off = (f"tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else
                   f"model_runner='{self.model_runner}'" if self.model_runner != "torch" else None)
            if off:
                raise ValueError(f"async_scheduling=true is not supported where {off}: leave it unset (off there)")
        if self.runner == "pooling":
            off = ("model_runner='%s'" % self.model_runner if self.model_runner != "torch" else
                   "speculative_config is set" if self.speculative_config is not None else
                   "enable_lora is set" if self.enable_lora else
                   f"tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else
                   "async_scheduling=true" if self.async_scheduling else None)
            if off:
                raise ValueError(f"runner='pooling' is not supported where {off} (it runs the torch model on one "
                                 "rank, in series)")
        elif self.pooler_config is not None:
            raise ValueError("pooler_config is for runner='pooling'")
        if self.cpu_forward_shards is not None and self.cpu_forward_shards > 1:
            off = (f"model_runner='{self.model_runner}'" if self.model_runner != "torch" else
                   "device='cuda'" if self.device == "cuda" else
                   "attention_backend='triton'" if self.attention_backend == "triton" else
                   f"tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else
                   f"pipeline_parallel_size={self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1 else
                   "enable_lora is set" if self.enable_lora else
                   f"speculative_config method '{self.speculative_config.method}' is set" if (
                       self.speculative_config is not None and self.speculative_config.reads_target_hidden) else
                   f"runner='{self.runner}'" if self.runner != "generate" else None)
            if off:
                raise ValueError(f"cpu_forward_shards={self.cpu_forward_shards} is not supported where {off} (it "
                                 "splits the torch model's forward on CPU, on one rank): leave it unset")
        if self.model_runner == "tensorrt" and self.device == "cpu":
            raise ValueError("model_runner='tensorrt' needs device 'cuda' (or 'auto' on a GPU machine)")
        for name in ("priority_aging_s", "lower_priority_prefill_tokens"):
            if getattr(self, name) is not None and self.scheduling_policy != "priority":
                raise ValueError(f"{name} needs scheduling_policy 'priority'")
        if self.kv_offloading_size is not None:
            off = ("enable_prefix_caching is false" if not self.enable_prefix_caching else
                   f"model_runner='{self.model_runner}'" if self.model_runner != "torch" else
                   f"runner='{self.runner}'" if self.runner != "generate" else
                   f"tensor_parallel_size={self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else
                   f"pipeline_parallel_size={self.pipeline_parallel_size}" if self.pipeline_parallel_size > 1 else
                   "a draft model is set" if (self.speculative_config is not None
                                              and self.speculative_config.has_draft_cache) else None)
            if off:
                raise ValueError(f"kv_offloading_size is not supported where {off} (the host tier extends one "
                                 "rank's prefix cache, for the torch model's KV only)")
        return self

    def _check_pipeline(self) -> None:
        pp = self.pipeline_parallel_size
        if self.max_concurrent_batches is not None and self.max_concurrent_batches > pp:
            raise ValueError(f"max_concurrent_batches={self.max_concurrent_batches} must be at most "
                             f"pipeline_parallel_size ({pp}): one batch per stage")
        if pp > 1:
            off = (f"model_runner='{self.model_runner}'" if self.model_runner != "torch" else
                   "speculative_config is set" if self.speculative_config is not None else
                   "enable_lora is set" if self.enable_lora else
                   f"runner='{self.runner}'" if self.runner != "generate" else
                   "async_scheduling=true" if self.async_scheduling else None)
            if off:
                raise ValueError(f"pipeline_parallel_size={pp} is not supported where {off}")
        world = self.tensor_parallel_size * pp
        if self.nnodes > 1 and world % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes}: tensor_parallel_size x pipeline_parallel_size = {world} ranks "
                             "must divide evenly over the nodes")

    @property
    def num_batches_in_flight(self) -> int:
        return self.max_concurrent_batches or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def use_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        # With speculation too (n-gram or a draft model, whose proposals stay on the device
        # until the step that verifies them): a speculating request then verifies every
        # other step (docs/reference/configuration.md, async_scheduling).
        return self.runner == "generate" and self.world_size == 1 and self.model_runner == "torch"

    def async_scheduling_on(self, device_type: str) -> bool:
        """Whether the engine schedules ahead on this device. Unset: as
        use_async_scheduling, except on the CPU, where nothing runs beside the host:
        scheduling a step ahead there overlaps nothing and only delays each arrival's
        first token by a step (vLLM's CPU backend runs in series too)."""
        if self.async_scheduling is None and device_type == "cpu":
            return False
        return self.use_async_scheduling

    @property
    def pooler(self) -> PoolerConfig:
        return self.pooler_config or PoolerConfig()

    @classmethod
    def create(cls, **kwargs) -> "EngineArgs":
        return validated(cls, ConfigError, "engine argument", **kwargs)


def validated(model_cls: type[BaseModel], error_cls: type[Exception], what: str, **kwargs):
    """Build a pydantic model, turning its report into one error that names each bad field."""
    try:
        return model_cls(**kwargs)
    except ValidationError as e:
        raise error_cls(format_validation_error(e, what)) from None


def format_validation_error(e: ValidationError, what: str) -> str:
    parts = []
    for err in e.errors():
        name = ".".join(str(p) for p in err["loc"])
        if not name:        # a check across fields: its message names them; the input is everything
            parts.append(f"invalid {what}s: {err['msg'].removeprefix('Value error, ')}")
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown {what} '{name}'")
        else:
            parts.append(f"invalid {what} '{name}': {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)
