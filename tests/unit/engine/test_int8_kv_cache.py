"""INT8 KV cache (`kv_cache_dtype="int8"`, per-KV-head scales calibrated by the builder):
the entry's scales reach the engine, the cache holds twice the blocks of a bf16 cache in
the same memory, and greedy tokens (chunked prefill, prefix-cache hits, both attention
backends) equal transformers' with K/V fake-quantized by the same scales (round(x / s)
clamped to +-127, times s) through an attention hook, logprobs within 1e-3 (fp32)."""

import os

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.config import ConfigError
from backend.triton_server.serving_config import load_settings
from builder.build import BuildOptions, build
from builder.kv_int8 import KV_SCALES_FILE, kv_hook
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import check_against_model

MAX_NEW = 8


def fake_quantized(scales: dict[str, torch.Tensor]):
    def fn(layer, key, value):                        # [B, KVH, L, D]
        out = []
        for which, x in (("k", key), ("v", value)):
            s = scales[f"model.layers.{layer}.self_attn.{which}_scale"].view(1, -1, 1, 1)
            q = torch.round(torch.clamp(x.float() * (torch.ones_like(s) / s), -127, 127))
            out.append((q * s).to(x.dtype))
        return tuple(out)
    return fn


def test_int8_kv_engine_equals_transformers_on_fake_quantized_kv(llama_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM
    entry = build(BuildOptions.create(checkpoint=llama_ckpt, output=str(tmp_path / "int8kv"), kv_cache="int8",
                                      link=True, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16),
                  log=lambda *_: None, progress=False)
    args, _ = load_settings({"model": llama_ckpt, "kv_cache_dtype": "int8", "kv_cache_scales": KV_SCALES_FILE},
                            entry)
    assert args.kv_cache_scales == os.path.join(entry, KV_SCALES_FILE)
    scales = load_file(args.kv_cache_scales)
    assert scales["model.layers.1.self_attn.k_scale"].shape == (2,)       # one per KV head

    # A shared 20-token prefix (block-aligned at 4): later prompts hit the prefix cache;
    # 16-token steps chunk the 40-token prompt.
    shared = random_prompts(1, [20], seed=3)[0]
    prompts = [shared + p for p in random_prompts(3, [1, 9, 20], seed=4)] + random_prompts(1, [40], seed=5)
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0, logprobs=3)
    llm = LLM(llama_ckpt, kv_cache_dtype="int8", kv_cache_scales=args.kv_cache_scales, block_size=4,
              num_kv_blocks=64, max_num_batched_tokens=16)
    outs = [llm.generate([p], params)[0] for p in prompts]        # one at a time: later ones hit the cache
    assert llm.stats()["kv_cache_dtype"] == "int8"
    assert llm.stats()["prefix_cache_hit_tokens"] >= 2 * 20
    ref = AutoModelForCausalLM.from_pretrained(llama_ckpt, dtype=torch.float32).eval()
    with kv_hook(ref, fake_quantized(scales)):
        worst = check_against_model(ref, prompts, outs, MAX_NEW)
    assert worst < 1e-3, worst
    assert_pool_free(llm)

    # The Triton kernels (interpreter on CPU) give the torch path's tokens.
    triton = LLM(llama_ckpt, kv_cache_dtype="int8", kv_cache_scales=args.kv_cache_scales, block_size=4,
                 num_kv_blocks=64, max_num_batched_tokens=16, attention_backend="triton")
    short = SamplingParams(max_tokens=4, min_tokens=4, temperature=0)
    got = triton.generate(prompts[1:3], short)
    assert [o.token_ids for o in got] == [o.token_ids[:4] for o in outs[1:3]]
    assert_pool_free(triton)


def test_int8_kv_capacity_and_config_errors(llama_ckpt, tmp_path):
    from backend.engine.runner.kv_int8 import load_kv_cache_scales, save_kv_cache_scales
    from backend.models.config import load_model_config
    from backend.parallel.sharding import kv_head_range
    path = str(tmp_path / "s.safetensors")
    k = torch.tensor([[0.05, 0.06], [0.07, 0.08]])
    save_kv_cache_scales(path, k, 2 * k)
    # A tensor-parallel rank takes its KV heads' scales.
    cfg = load_model_config(llama_ckpt)
    assert load_kv_cache_scales(path, cfg, kv_head_range(cfg, 1, 2)) == [([k[0, 1].item()], [2 * k[0, 1].item()]),
                                                                        ([k[1, 1].item()], [2 * k[1, 1].item()])]
    budget = 256 * 1024
    bf16 = LLM(llama_ckpt, dtype="bfloat16", block_size=16, kv_cache_memory_bytes=budget)
    int8 = LLM(llama_ckpt, dtype="bfloat16", block_size=16, kv_cache_memory_bytes=budget, kv_cache_dtype="int8",
               kv_cache_scales=path)
    assert int8.stats()["num_total_blocks"] == 2 * bf16.stats()["num_total_blocks"]
    with pytest.raises(ConfigError, match="kv_cache_scales"):
        LLM(llama_ckpt, kv_cache_dtype="int8")
    save_kv_cache_scales(path, torch.full((2, 3), 0.05), torch.full((2, 3), 0.05))
    with pytest.raises(ConfigError, match=r"'kv_cache_scales'.*k_scale is shape \(3,\); expected \[2\]"):
        LLM(llama_ckpt, kv_cache_dtype="int8", kv_cache_scales=path)
