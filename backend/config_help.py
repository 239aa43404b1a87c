"""What each engine argument and server setting means, for the configuration reference
(docs/reference/configuration.md, written by `python -m tools.docs_reference`). Types,
defaults and ranges come from the validated models themselves (backend/config.py
EngineArgs, backend/triton_server/serving_config.py ServerSettings); a test fails when a
field has no entry here, or an entry no field."""

ENGINE_ARGS = {
    "model": "The checkpoint: a local Hugging Face folder (in config.pbtxt, relative to the model directory). "
             "Nothing is downloaded from a model hub.",
    "dtype": "Weights' and activations' dtype; `auto` takes the checkpoint's.",
    "device": "Where the engine runs; `auto` takes CUDA when present, else the CPU.",
    "block_size": "Tokens per KV block.",
    "num_kv_blocks": "KV pool size in blocks. Unset: sized from `kv_cache_memory_bytes` (CPU, default 1 GiB) or, "
                     "on a GPU, from `gpu_memory_utilization`.",
    "kv_cache_memory_bytes": "KV cache bytes per device, instead of `gpu_memory_utilization`.",
    "gpu_memory_utilization": "On a GPU, the fraction of the device's total memory this engine may use, as in vLLM "
                              "(several engines share a device when their fractions leave room).",
    "max_num_seqs": "Requests in the running batch.",
    "max_num_batched_tokens": "Token budget of one step: decode tokens plus prefill chunks.",
    "max_model_len": "Prompt plus output limit. Unset: the model's, bounded by the pool.",
    "enable_prefix_caching": "Share full KV blocks between requests with the same prefix.",
    "kv_offloading_size": "GiB of host memory for a KV tier below the device pool (vLLM's name): computed blocks "
                          "are kept there too, and a prefix past the pool's hits is copied back instead of "
                          "recomputed.",
    "max_queue_size": "Waiting requests beyond this are refused with `UNAVAILABLE` (0 refuses every request). "
                      "Unset: no limit.",
    "scheduling_policy": "`fcfs` admits requests in arrival order; `priority` by each request's `priority` (lower "
                         "first), preempting lower priorities first (vLLM's names).",
    "priority_aging_s": "Under `priority`: a request's priority improves by one level per this many seconds "
                        "since it arrived, so a steady stream of higher priorities cannot starve it. Unset: no "
                        "aging.",
    "lower_priority_prefill_tokens": "Under `priority`: at most this many prompt tokens a step for requests "
                                     "ranked below the best-ranked request present, so steps stay short while "
                                     "better-ranked work is around (a better-ranked arrival waits less). Unset: "
                                     "no cap.",
    "seed": "Seed of the engine's sampler (a request's own `seed` overrides it for that request).",
    "attention_backend": "`triton`: the OpenAI Triton kernels (CUDA, or the interpreter); `torch`: the torch "
                         "path and its C++ CPU kernels; `auto`: triton on CUDA, torch on the CPU.",
    "kv_cache_dtype": "`fp8` stores K/V in E4M3 (an FP8 build's calibrated scales, else 1.0); `int8` in symmetric "
                      "INT8 with per-KV-head scales (needs `kv_cache_scales`).",
    "kv_cache_scales": "With `int8`: the scales file `builder build --kv-cache int8` writes.",
    "model_runner": "`torch` runs the checkpoint; `onnxruntime` or `tensorrt` an exported graph "
                    "(`builder build --engine`).",
    "model_graph": "That graph's path (`1/model.onnx`, `1/model.plan`).",
    "enforce_eager": "vLLM's name: every step eagerly; otherwise, on CUDA with `triton`, decode and verify steps "
                     "replay CUDA graphs captured at load.",
    "tensor_parallel_size": "Ranks the model is split over (docs: parallelism).",
    "pipeline_parallel_size": "Pipeline stages, each of `tensor_parallel_size` ranks (docs: parallelism).",
    "max_concurrent_batches": "Micro-batches in flight under pipeline parallelism (vLLM's name). Unset: "
                              "`pipeline_parallel_size`.",
    "nnodes": "Machines the ranks span; this process is node 0 (docs: multi-node).",
    "master_addr": "Address of the rendezvous store node 0 serves. Unset: `MASTER_ADDR`.",
    "master_port": "Port of that store. Unset: `MASTER_PORT`, else 29500.",
    "node_join_timeout_s": "How long the load waits for the other nodes to join.",
    "node_health_timeout_s": "A node whose heartbeats stop this long fails the model.",
    "enable_expert_parallel": "A MoE model's experts placed whole on the ranks instead of sliced over them "
                              "(vLLM's name).",
    "speculative_config": "Speculative decoding, vLLM's JSON: `method` (`ngram`, `draft_model`, `eagle`, `eagle3`, "
                          "`medusa`), `num_speculative_tokens`, `model`, `speculative_token_tree`, "
                          "`prompt_lookup_min`/`max` (docs: speculative decoding).",
    "kv_events_config": "KV cache events over ZMQ for KV-aware routers, vLLM's JSON (docs: Dynamo).",
    "async_scheduling": "vLLM's name: schedule step N+1 while the device runs step N. Unset: on wherever the "
                        "output stays exact (not with tensor or pipeline parallelism, nor the exported-graph "
                        "runners) and a device runs beside the host: off on the CPU, where scheduling ahead "
                        "overlaps nothing and only delays each arrival's first token by a step.",
    "cpu_forward_shards": "On the CPU, the forward split by sequences into this many shards on their own threads. "
                          "Unset: 2 where it pays (a small model on at least 2 threads, one rank, no LoRA); 1: off.",
    "runner": "`generate`, or `pooling` for an embedding model (vLLM's names).",
    "pooler_config": "With `pooling`: `{\"pooling_type\": \"LAST\" | \"MEAN\", \"normalize\": true}`.",
    "enable_lora": "Multi-LoRA on (adapters given in `lora_modules` turn it on).",
    "lora_modules": "Adapters by name: `{\"name\": \"PEFT folder\"}` or `name=folder,...`.",
    "max_loras": "Adapters resident on the device at once (slots, least recently used out).",
    "max_lora_rank": "The largest adapter rank accepted.",
    "max_cpu_loras": "Adapters kept loaded in host memory. Unset: all that are registered.",
    "limit_mm_per_prompt": "Items per prompt by modality, vLLM's `{\"image\": N}`; `{\"image\": 0}` refuses images.",
    "max_num_encoder_input_tokens": "Vision-tower output rows encoded per step (vLLM's name). Unset: "
                                    "`max_num_batched_tokens`, raised to the largest image.",
    "encoder_cache_size": "Vision-tower output rows kept, by image content hash (vLLM's name). Unset: as above.",
    "max_image_bytes": "The largest encoded image accepted.",
    "max_image_pixels": "The largest image accepted, in pixels (read from its header before decoding).",
    "max_n": "The largest `n` (sequences per request).",
    "max_logprobs": "The largest `logprobs` count (vLLM's name and default).",
    "max_stop_strings": "Stop strings per request.",
    "max_stop_string_len": "Characters per stop string.",
    "max_stop_token_ids": "Stop token ids per request.",
    "max_guided_spec_bytes": "Size of a structured-output spec (JSON schema, regex, choices, grammar) in bytes.",
    "guided_compile_timeout_s": "A grammar still compiling after this many seconds fails its request alone.",
    "request_timeout_s": "Server-side deadline from arrival: a request unfinished then is aborted with an error "
                         "(a request may ask for a shorter one). Unset: none.",
}

SERVER_SETTINGS = {
    "grace_period_s": "On unload or shutdown, how long in-flight streams may run before they are cancelled.",
    "cancel_poll_interval_s": "How often client cancellations are polled.",
    "engine_stall_timeout_s": "While requests wait, some engine step must complete this often, or the model is "
                              "marked unhealthy and unloaded (the supervisor loads it again).",
    "report_metrics": "Export the engine's metrics on Triton's metrics port (the vLLM backend's "
                      "`REPORT_CUSTOM_METRICS`).",
}
