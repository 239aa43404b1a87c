"""GPU check and benchmark, in one call, on one NVIDIA GPU (issue 12's targets).

    python -m benchmarks.gpu_check --out results/          # writes gpu_check.json and gpu_check.md
    python -m benchmarks.gpu_check --stages models attention --models llama-3.2-1b --budget-s 200
    python -m benchmarks.gpu_check --perf [--dry-run]      # issue 50's table in 8 minutes (gpu_perf.py)

Needs only torch, triton, transformers, numpy and pydantic (no tritonclient, no network;
packages may live outside site-packages: child processes inherit sys.path). Every stage
is isolated (a failure is recorded with its traceback, the next stage runs), results are
written after each, and --budget-s starts nothing past a deadline. On the H100 of
2026-11-27 the stages took: models (1B) 46 s, attention 5 s, MoE kernel 12 s, quant
kernels 6 s, structured output 7 s, speculative 58 s, LoRA and INT4 35 s, kernel unit
tests 102 s with --test-workers 8; an 8B model's decode stage about 50 s with its
checkpoint.

1. Random-weight checkpoints of real configurations made on the spot (bf16).
2. Speculative decoding on CUDA (n-gram and draft model): greedy agreement, sampled
   requests, batch-1 decode with prompt lookup (benchmarks/bench_spec.py's workload).
3. Sampled requests on CUDA: temperature, top-k/top-p/min-p, seeds, penalties and
   min_tokens together; a seeded request alone vs inside a batch.
4. The nano-vllm workload: 256 sequences, prompt and output lengths U[100, 1024],
   temperature 0.6, ignore_eos, Llama-3.2-1B configuration, one generate call
   (target: >= 20,000 output tok/s).
4b. One decode step taken apart at that batch (256 sequences of 512-token prompts, 10
   steps under torch's profiler): wall and kernel time per step and the top kernels.
5. Attention kernels alone against the K/V read floor (benchmarks/attention_bench.py):
   the one-token and the tiled kernel on decode and prefill shapes. The fused MoE
   kernel alone against its weight-read floor (benchmarks/moe_kernel_bench.py): a
   Mixtral-8x7B layer, a gpt-oss-20b layer in bf16 and with MXFP4 experts. The W8A8 INT8
   GEMM and the INT8 KV cache's attention against bf16 (benchmarks/quant_kernel_bench.py).
5b. An EAGLE-3 round (chains of 2 and 4, trees of 4 and 8 nodes) against a plain decode
   step on a Llama-3.1-8B-shaped random model (benchmarks/bench_eagle_step.py; speed-up
   projected from the CPU acceptance lengths).
6. LoRA decode-step overhead with 1, 4, 16 adapters (benchmarks/bench_lora.py) and INT4
   decode at batch 1 vs bf16 (benchmarks/bench_int.py) on the last model.
6b. Decode latency at batch 1 and 32, with CUDA graphs and eagerly (one engine each),
   against the weight-read floor (weight bytes / measured copy bandwidth; target at
   batch 1 for Llama-3.1-8B: <= 1.25x); also a Mixtral-8x7B-shaped MoE model of two
   layers (tokens/s; its floor counts every expert's bytes, which a batch-1 step does
   not read: the kernel stage has the per-step floor).
7. Unit tests natively on CUDA (pytest, if installed): kernels, fused ops, sampler,
   CUDA graphs vs eager, engine exactness. Results are written after every stage.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import shutil
import tempfile
import time
import traceback

import torch
from benchmarks.device_bandwidth import copy_bandwidth_gbs

ARCHS = {
    "llama-3.2-1b": dict(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         tie_word_embeddings=True, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-3.1-8b": dict(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=False, rope_theta=500000.0,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Mixtral-8x7B's layer shape, two layers: the MoE stage (fused MoE kernel in a model).
    "mixtral-8x7b-2l": dict(arch="MixtralForCausalLM", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
                            rope_theta=1000000.0),
    "qwen3-0.6b": dict(arch="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True, rope_theta=1000000.0),
}
UNIT_TESTS = ["tests/unit/attention", "tests/unit/ops", "tests/unit/models", "tests/unit/engine/sampling/test_sampler.py",
              "tests/unit/engine/runner/test_cuda_graphs.py", "tests/unit/engine/test_exactness.py",
              "tests/unit/engine/test_llm_engine.py", "tests/unit/engine/spec_decode", "tests/unit/lora/test_punica.py"]
KERNEL_TESTS = ("tests/unit/attention", "tests/unit/ops", "tests/unit/lora/test_punica.py")


def make_checkpoint(name: str, root: str) -> str:
    """Random bf16 weights for the named configuration, written as a checkpoint folder."""
    import transformers as tf
    spec = dict(ARCHS[name])
    arch = spec.pop("arch")
    cfg_cls = {"Qwen3ForCausalLM": tf.Qwen3Config, "MixtralForCausalLM": tf.MixtralConfig}.get(arch, tf.LlamaConfig)
    cfg = cfg_cls(max_position_embeddings=8192, initializer_range=0.02, dtype="bfloat16", **spec)
    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    with torch.device("cuda"):
        model = getattr(tf, arch)(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def _pytest(targets: list[str], workers: int, timeout_s: float, env: dict) -> tuple[list[str], str]:
    """(one line per failing test, the summary line)."""
    extra = ["-n", str(workers)] if workers > 1 else []
    try:
        # --tb=short: the summary's FAILED lines then name the error (bare with --tb=line).
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short",
                               *extra, *targets], capture_output=True, text=True, env=env, timeout=timeout_s)
        out = proc.stdout
    except subprocess.TimeoutExpired as e:
        out = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "") + f"\ntimed out after {timeout_s:.0f} s"
    lines = out.strip().splitlines()
    return [ln[:400] for ln in lines if ln.startswith(("FAILED", "ERROR"))], (lines[-1] if lines else "no output")


def run_unit_tests(workers: int = 0, timeout_s: int = 400, tests: list[str] | None = None) -> str:
    """The kernel tests (no engine) spread over `workers` pytest-xdist processes, then the
    engine tests in one process: each engine sizes its KV cache from the GPU's free memory,
    which engines in parallel processes would take from each other."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        return "pytest not installed: unit tests not run"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        import xdist  # noqa: F401       # compiling each test's kernels is CPU work: spread it
    except ImportError:
        workers = 0
    targets = tests or UNIT_TESTS
    kernels = [t for t in targets if t.startswith(KERNEL_TESTS)]
    engines = [t for t in targets if t not in kernels]
    t0, lines = time.perf_counter(), []
    for group, n in ((kernels, workers), (engines, 0)):
        if group:
            left = timeout_s - (time.perf_counter() - t0)
            failed, summary = _pytest(group, n, max(left, 10.0), env)
            lines += failed + [f"{' '.join(group)}: {summary}"]
    return "\n".join(lines)


def _llm(path: str, **kw):
    from backend import LLM
    args = dict(dtype="bfloat16", block_size=16, gpu_memory_utilization=0.85, attention_backend="triton")
    args.update(kw)
    return LLM(path, **args)


def _vocab(path: str) -> int:
    from backend.models.config import load_model_config
    return load_model_config(path).vocab_size


def _free(llm) -> None:
    """Check that the pool is free and stop the engine. The caller drops its reference and
    calls _release(): the next engine sizes its KV cache from the device's free memory."""
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
    llm.close()


def _release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def sampled_requests(path: str) -> dict:
    """Every sampling feature on CUDA in one batch; a seeded request alone vs in a batch."""
    from backend import SamplingParams
    llm = _llm(path, max_num_seqs=16, max_num_batched_tokens=4096)
    common = dict(max_tokens=32, ignore_eos=True)
    params = [SamplingParams(temperature=0.8, **common), SamplingParams(temperature=1.0, top_p=0.9, **common),
              SamplingParams(temperature=0.7, top_k=40, seed=7, **common),
              SamplingParams(temperature=1.1, min_p=0.05, repetition_penalty=1.2, **common),
              SamplingParams(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, seed=8, **common),
              SamplingParams(temperature=0.8, min_tokens=16, stop_token_ids=[5], **common),
              SamplingParams(temperature=0, repetition_penalty=1.3, **common)]
    vocab = _vocab(path)
    prompts = [[((13 * i + j) % 5000 + 3) % vocab for j in range(20 + 7 * i)] for i in range(len(params))]
    outs = llm.generate(prompts, params)
    ok = all(len(o.token_ids) == 32 and o.finish_reason == "length" for o in outs)
    alone = llm.generate([prompts[2]], params[2])[0].token_ids
    _free(llm)
    return {"completed": ok, "requests": len(outs),
            "seeded_alone_equals_in_batch": alone == outs[2].token_ids}


def structured_requests(root: str) -> dict:
    """Structured output and logit_bias on CUDA (the default model, which has a
    tokenizer): every JSON-schema output parses, the biased token wins."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return {"skipped": "xgrammar is not installed"}
    from backend import SamplingParams
    from builder.tiny import build_tiny
    path = build_tiny(os.path.join(root, "default-model"))
    llm = _llm(path, max_num_seqs=16)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "tag": {"enum": ["a", "b"]}}, "required": ["n", "tag"]}
    outs = llm.generate(["Give JSON"] * 8, [SamplingParams(max_tokens=64, seed=i, guided_json=schema)
                                            for i in range(8)])
    parsed = 0
    for o in outs:
        try:
            parsed += isinstance(json.loads(o.text), dict)
        except ValueError:
            pass
    biased = llm.generate(["x"], SamplingParams(max_tokens=4, temperature=0, logit_bias={77: 100.0}))[0]
    _free(llm)
    return {"json_outputs_parsed": f"{parsed}/8", "logit_bias_token_wins": biased.token_ids == [77] * 4}


def nano_vllm_workload(path: str, num_seqs: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0,
                       enforce_eager: bool = False) -> dict:
    """nano-vllm's bench.py workload, same distributions and seed scheme."""
    from backend import SamplingParams
    rng = random.Random(seed)
    top = min(10000, _vocab(path) - 1)
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(lo, hi))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=rng.randint(lo, hi)) for _ in range(num_seqs)]
    llm = _llm(path, max_num_seqs=num_seqs, max_num_batched_tokens=16384, max_model_len=4096,
               enforce_eager=enforce_eager)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))          # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == sum(p.max_tokens for p in params)
    graphs = llm.engine.runner.graphs is not None
    _free(llm)
    return {"output_tokens": tokens, "seconds": dt, "output_tok_per_s": tokens / dt, "cuda_graphs": graphs}


def decode_profile(path: str, num_seqs: int = 256, prompt_len: int = 512, steps: int = 10, top: int = 12) -> dict:
    """Where a decode step's time goes at the nano-vllm workload's batch: num_seqs
    requests prefilled, then `steps` decode steps under torch's profiler. Returns the
    wall time per step, the device time per step and its top kernels (by self time), so
    that one call says whether the step waits on the host or on which kernel."""
    from torch.profiler import ProfilerActivity, profile

    from backend import SamplingParams
    llm = _llm(path, max_num_seqs=num_seqs, max_num_batched_tokens=16384, max_model_len=4096)
    eng = llm.engine
    vocab = min(10000, _vocab(path) - 1)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=steps + 8, min_tokens=steps + 8, temperature=0.6, ignore_eos=True)
    for _ in range(num_seqs):
        eng.add_request([rng.randint(0, vocab) for _ in range(prompt_len)], params)
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                       for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()                                                   # graphs replayed, caches warm
    cuda = eng.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if key(e) > 0), key=key, reverse=True)
    device_us = sum(key(e) for e in events)
    while eng.has_unfinished_requests():
        eng.step()
    _free(llm)
    del llm, eng
    _release()
    return {"num_seqs": num_seqs, "prompt_len": prompt_len, "steps": steps,
            "wall_ms_per_step": 1e3 * wall / steps,
            ("device_ms_per_step" if cuda else "op_ms_per_step"): device_us / 1e3 / steps,
            "top": [{"name": e.key[:80], "ms_per_step": key(e) / 1e3 / steps, "calls_per_step": e.count / steps}
                    for e in events[:top]]}


def decode_benchmarks(path: str, batches: list[int], enforce_eager: bool, prompt_len: int = 128,
                      new_tokens: int = 128) -> list[dict]:
    """ms per pure-decode step at each batch size, one engine (one weight load) for all."""
    from backend import SamplingParams
    llm = _llm(path, max_num_seqs=max(batches), max_num_batched_tokens=max(2048, max(batches) * prompt_len),
               enforce_eager=enforce_eager)
    eng = llm.engine
    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0, ignore_eos=True)
    rows = []
    for batch in batches:
        prompts = [[((7 * i + j) % 1000 + 10) % _vocab(path) for j in range(prompt_len)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, temperature=0))  # warm-up
        for p in prompts:
            eng.add_request(p, params)
        while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                           for r in eng.scheduler.requests.values()):
            eng.step()                                               # prefill all
        torch.cuda.synchronize()
        t0, steps = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if eng.async_scheduling:
            steps -= 1      # the last call only collects the last decode step's tokens
        rows.append({"batch": batch, "cuda_graphs": eng.runner.graphs is not None, "decode_steps": steps,
                     "ms_per_step": 1e3 * dt / steps, "tokens_per_s": batch * steps / dt,
                     "weight_bytes": weight_bytes(eng.model)})
    _free(llm)
    del llm, eng
    _release()
    return rows


SPEC_BENCH = ["--tokens", "256", "--repeats", "2", "--hidden", "2048", "--layers", "16", "--heads", "16",
              "--vocab", "32000", "--window", "32", "--configs", "off", "ngram k=4", "ngram k=8"]


def speculative_requests(root: str, bench_args: list[str] = SPEC_BENCH) -> dict:
    """Speculative decoding on CUDA: greedy tokens with n-gram, draft-model, EAGLE-3 and
    Medusa proposers (random heads in the published layouts) against speculation off
    (bf16: kernels of different shapes may round differently, so the agreement is
    reported, not asserted), sampled requests complete with the pool free, and batch-1
    decode with prompt lookup on the workload of benchmarks/bench_spec.py at a 1B-class
    size."""
    from backend import SamplingParams
    from builder.eagle_heads import random_head
    from builder.medusa_heads import random_heads
    from builder.tiny import build_tiny
    from benchmarks import bench_spec
    path = build_tiny(os.path.join(root, "default-model"))
    head = random_head(path, os.path.join(root, "eagle3-head"), draft_vocab=1024)
    medusa = random_heads(path, os.path.join(root, "medusa-heads"), num_heads=4)
    prompts = ["the cat sat on the mat. the cat sat on the mat. the cat", "def add(a, b):\n    return a + b\n\ndef"]
    greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    plain = _llm(path, max_num_seqs=16)
    reference = [o.token_ids for o in plain.generate(prompts, greedy)]
    _free(plain)
    del plain
    _release()
    report = {}
    for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 4}),
                       ("draft_model", {"method": "draft_model", "model": path, "num_speculative_tokens": 4}),
                       ("eagle3", {"method": "eagle3", "model": head, "num_speculative_tokens": 4}),
                       ("medusa", {"method": "medusa", "model": medusa, "num_speculative_tokens": 4})):
        llm = _llm(path, max_num_seqs=16, speculative_config=spec)
        outs = [o.token_ids for o in llm.generate(prompts, greedy)]
        sampled = llm.generate(prompts * 4, [SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=i,
                                                            ignore_eos=True, repetition_penalty=1.1)
                                             for i in range(8)])
        stats = llm.stats()
        report[name] = {"greedy_tokens_equal": sum(a == b for x, y in zip(outs, reference) for a, b in zip(x, y)),
                        "greedy_tokens": sum(len(r) for r in reference),
                        "sampled_completed": all(len(o.token_ids) == 32 for o in sampled),
                        "acceptance_rate": stats["spec_decode_acceptance_rate"]}
        drafter = llm.engine.runner.drafter
        if drafter is not None and hasattr(drafter, "graphs"):   # a draft model's or head's own CUDA graphs
            report[name]["draft_graphs_captured"] = len(drafter.graphs.shapes) if drafter.graphs else 0
        _free(llm)
        del llm
        _release()
    report["bench_spec"] = bench_spec.main(bench_args)["results"]
    return report


LORA_BENCH = ["--device", "cuda", "--dtype", "bfloat16", "--hidden", "2048", "--layers", "16", "--heads", "16",
              "--vocab", "32000", "--batch", "16", "--rank", "16", "--tokens", "64", "--repeats", "2"]


def lora_and_int(root: str, model_path: str) -> dict:
    """Issue 15's GPU targets: LoRA's decode-step overhead with 1, 4 and 16 adapters in a
    batch of 16 (target at 16: <= 1.3x), and INT4 (GPTQ layout, g128) decode at batch 1
    against bf16 on `model_path` (target: <= 0.4x)."""
    from benchmarks import bench_int, bench_lora
    return {"lora": bench_lora.main(LORA_BENCH)["results"],
            "int4": bench_int.main(["--checkpoint", model_path, "--tokens", "64", "--repeats", "2"])["results"]}


EAGLE_STEP = ["--shape", "8b", "--device", "cuda", "--dtype", "bfloat16", "--batch", "1", "16", "64",
              "--tokens", "24", "--repeats", "2"]


def eagle_step(args: list[str] = EAGLE_STEP) -> list[dict]:
    """Issue 53's GPU figure: an EAGLE-3 round's cost (chains and trees) against a plain
    decode step on a Llama-3.1-8B-shaped random model at batch 1, 16 and 64, and the speed-up it projects
    from the trained head's CPU acceptance lengths (benchmarks/bench_eagle_step.py; target
    at batch 1: >= 2x)."""
    from benchmarks import bench_eagle_step
    return bench_eagle_step.main(args)["results"]


# Qwen2.5-VL-7B's shapes (config.json of Qwen/Qwen2.5-VL-7B-Instruct), the decoder cut to
# `layers` layers so that a random checkpoint writes in seconds; the tower whole.
QWEN2_5_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                          num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                           "rope_theta": 1000000.0})
QWEN2_5_VL_7B_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                            patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                            fullatt_block_indexes=[7, 15, 23, 31])


def make_vision_checkpoint(root: str, layers: int = 4, device: str = "cuda", dtype=torch.bfloat16,
                           text: dict = QWEN2_5_VL_7B_TEXT, vision: dict = QWEN2_5_VL_7B_VISION) -> str:
    """A random Qwen2.5-VL checkpoint of the given shapes (bf16) with its image processor's
    config (transformers' defaults: up to 1280 tokens an image)."""
    import transformers as tf
    path = os.path.join(root, f"qwen2.5-vl-7b-{layers}l")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    vocab = text["vocab_size"]      # (the published special ids, or the last four of a small vocabulary)
    ids = {} if vocab > 151656 else dict(image_token_id=vocab - 4, video_token_id=vocab - 3,
                                         vision_start_token_id=vocab - 2, vision_end_token_id=vocab - 1)
    cfg = tf.Qwen2_5_VLConfig(text_config={**text, "num_hidden_layers": layers, "initializer_range": 0.02},
                              vision_config={**vision, "initializer_range": 0.02}, dtype=str(dtype).split(".")[-1],
                              **ids)
    with torch.device(device):
        model = tf.Qwen2_5_VLForConditionalGeneration(cfg).to(dtype)
    model.save_pretrained(path)
    tf.Qwen2VLImageProcessorPil().save_pretrained(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return path


def vision(root: str, args: list[str] | None = None, **checkpoint) -> dict:
    """Issue 52's GPU figure: one-image chat prompts on a Qwen2.5-VL-7B-shaped random model
    (4 decoder layers, the whole tower), the engine against transformers, bf16, 448 x 448
    images (256 tokens each), and the encoder cache on a repeated image
    (benchmarks/bench_vision.py)."""
    from benchmarks import bench_vision
    path = make_vision_checkpoint(root, **checkpoint)
    return bench_vision.main(["--checkpoint", path] + (args if args is not None else [
        "--device", "cuda", "--dtype", "bfloat16", "--image-size", "448", "--requests", "16", "--tokens", "64",
        "--repeats", "2"]))


# The end-to-end figures first (a lease is short), the unit tests last (their first
# compiles are slow).
STAGES = ["models", "attention", "moe_kernel", "quant_kernels", "structured_output", "speculative", "eagle_step",
          "vision", "lora_and_int", "unit_tests"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_results"))
    # The last model also runs the LoRA / INT4 stage (a dense one).
    ap.add_argument("--models", nargs="+", default=["llama-3.2-1b", "mixtral-8x7b-2l", "llama-3.1-8b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--stages", nargs="+", choices=STAGES, default=STAGES,
                    help="which stages, in this order (a device lease is short: put first what must not be lost)")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--tests", nargs="+", default=None, help="pytest targets instead of the default list")
    ap.add_argument("--test-workers", type=int, default=0, help="pytest-xdist workers for the unit tests")
    ap.add_argument("--test-timeout-s", type=int, default=400)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no stage after this many seconds; the report says which were skipped")
    ap.add_argument("--perf", action="store_true", help="issue 50's performance table instead, in at most 8 "
                    "minutes (benchmarks/gpu_perf.py)")
    ap.add_argument("--dry-run", action="store_true", help="with --perf: print and check the plan, run nothing")
    ap.add_argument("--perf-stages", nargs="+", help="with --perf: only these stages")
    a = ap.parse_args(argv)
    if a.perf:
        from benchmarks import gpu_perf
        return gpu_perf.main(a.out, a.dry_run, a.perf_stages)
    if not torch.cuda.is_available():
        print("gpu_check needs an NVIDIA GPU (torch.cuda.is_available() is False)")
        return 2
    try:
        import pydantic  # noqa: F401
    except ImportError:
        print("gpu_check needs pydantic (carry its wheels: see the device tool's README)")
        return 2
    os.makedirs(a.out, exist_ok=True)
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": "python -m benchmarks.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
              "unit_tests": "skipped", "stage_seconds": {}, "stage_errors": {}}
    t_start = time.perf_counter()
    report["copy_bandwidth_gbs"] = bw = copy_bandwidth_gbs()
    report["models"] = {}

    def save() -> None:                  # partial results survive a timeout
        with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=2)

    root = tempfile.mkdtemp(dir=os.environ.get("TMPDIR"))

    def past_budget() -> bool:
        return a.budget_s is not None and time.perf_counter() - t_start > a.budget_s

    def kernels(name: str) -> None:
        import importlib
        mod = importlib.import_module({"attention": "benchmarks.attention_bench", "moe_kernel": "benchmarks.moe_kernel_bench",
                                       "quant_kernels": "benchmarks.quant_kernel_bench"}[name])
        report[name] = mod.run(bw, torch.device("cuda"))
        print(mod.render(report[name]), flush=True)

    def models() -> None:
        for name in a.models:
            if past_budget():
                report["stage_errors"][f"models/{name}"] = "skipped: past --budget-s"
                continue
            path = make_checkpoint(name, root)
            entry = report["models"][name] = {}
            if name == "llama-3.2-1b":
                for key, fn in (("sampled_requests", sampled_requests), ("nano_vllm_workload", nano_vllm_workload),
                                ("decode_profile", decode_profile)):
                    try:
                        entry[key] = fn(path)
                    except Exception as e:     # noqa: BLE001 - one failure must not cost the rest
                        entry[key] = {"error": f"{type(e).__name__}: {e}"}
                        report["stage_errors"][f"{name}/{key}"] = traceback.format_exc()[-3000:]
                    _release()
                print(name, json.dumps(entry), flush=True)
                save()
            try:
                rows = [r for eager in (False, True) for r in decode_benchmarks(path, a.batches, eager)]
            except Exception as e:            # noqa: BLE001 - a failing model must not cost the later stages
                entry["error"] = f"{type(e).__name__}: {e}"
                report["stage_errors"][f"{name}/decode"] = traceback.format_exc()[-3000:]
                print(name, entry["error"], flush=True)
                save()
                _release()
                continue
            for r in rows:
                r["weight_read_floor_ms"] = r["weight_bytes"] / (bw * 1e9) * 1e3
                r["x_of_floor"] = r["ms_per_step"] / r["weight_read_floor_ms"]
            entry["decode"] = rows
            print(name, json.dumps(rows), flush=True)
            save()

    def unit_tests() -> None:
        report["unit_tests"] = run_unit_tests(a.test_workers, a.test_timeout_s, a.tests)
        print("unit tests:", report["unit_tests"], flush=True)

    def structured() -> None:
        report["structured_output"] = structured_requests(root)
        print("structured output:", report["structured_output"], flush=True)

    def speculative() -> None:
        report["speculative"] = speculative_requests(root)
        print("speculative decoding:", json.dumps(report["speculative"]), flush=True)

    def eagle() -> None:
        report["eagle_step"] = eagle_step()
        print("EAGLE-3 step cost:", json.dumps(report["eagle_step"]), flush=True)

    def vision_stage() -> None:
        report["vision"] = vision(root)
        print("vision-language:", json.dumps(report["vision"]), flush=True)

    def lora() -> None:
        report["lora_and_int"] = lora_and_int(root, make_checkpoint(a.models[-1], root))
        print("LoRA and INT4:", json.dumps(report["lora_and_int"]), flush=True)

    run = {"attention": lambda: kernels("attention"), "moe_kernel": lambda: kernels("moe_kernel"),
           "quant_kernels": lambda: kernels("quant_kernels"), "structured_output": structured,
           "speculative": speculative, "eagle_step": eagle, "vision": vision_stage, "models": models,
           "lora_and_int": lora,
           "unit_tests": unit_tests}
    stages = [st for st in a.stages if not (st == "unit_tests" and a.skip_tests)]
    for stage in stages:
        if past_budget():
            report["stage_errors"][stage] = "skipped: past --budget-s"
            continue
        t0 = time.perf_counter()
        try:
            run[stage]()
        except Exception as e:                 # noqa: BLE001 - each stage reports, the next one runs
            report["stage_errors"][stage] = traceback.format_exc()[-3000:]
            print(f"stage {stage} failed: {type(e).__name__}: {e}", flush=True)
        report["stage_seconds"][stage] = round(time.perf_counter() - t0, 1)
        _release()
        save()
    shutil.rmtree(root, ignore_errors=True)
    report["seconds"] = time.perf_counter() - t_start
    save()
    text = render(report)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def render(report: dict) -> str:
    lines = [f"GPU: {report['gpu']}, torch {report['torch']}, {report['date']} ({report.get('seconds', 0):.0f} s)",
             f"command: {report['command']}", f"unit tests: {report['unit_tests']}",
             f"copy bandwidth: {report['copy_bandwidth_gbs']:.0f} GB/s",
             f"structured output and logit_bias on CUDA: {report.get('structured_output')}",
             f"speculative decoding on CUDA: {report.get('speculative')}",
             f"EAGLE-3 round cost (8B shape) and projected speed-up: {report.get('eagle_step')}",
             f"Vision-language (Qwen2.5-VL-7B shape, 4 decoder layers): {report.get('vision')}",
             f"LoRA overhead and INT4 decode on CUDA: {report.get('lora_and_int')}",
             f"seconds per stage: {report.get('stage_seconds')}", ""]
    for stage, err in report.get("stage_errors", {}).items():
        lines.append(f"stage {stage} failed: {err.strip().splitlines()[-1] if err.strip() else err}")
    for name, entry in report["models"].items():
        if "nano_vllm_workload" in entry:
            w = entry["nano_vllm_workload"]
            lines.append(f"{name}: nano-vllm workload {w['output_tokens']} tokens in {w['seconds']:.1f} s = "
                         f"{w['output_tok_per_s']:.0f} output tok/s (target >= 20,000; CUDA graphs {w['cuda_graphs']})")
            lines.append(f"{name}: sampled requests on CUDA: {entry['sampled_requests']}")
        prof = entry.get("decode_profile")
        if prof and "top" in prof:
            dev = prof.get("device_ms_per_step", prof.get("op_ms_per_step", 0.0))
            lines.append(f"{name}: decode step at {prof['num_seqs']} sequences of {prof['prompt_len']}+ tokens: "
                         f"{prof['wall_ms_per_step']:.2f} ms wall, {dev:.2f} ms of kernels; top kernels (ms/step): "
                         + ", ".join(f"{k['name']} {k['ms_per_step']:.3f}" for k in prof["top"][:6]))
    if report.get("attention"):
        from benchmarks.attention_bench import render as render_attention
        lines += ["", "Attention kernels (Llama-3.2-1B shapes, bf16) vs the K/V read floor:", "",
                  render_attention(report["attention"])]
    if report.get("moe_kernel"):
        from benchmarks.moe_kernel_bench import render as render_moe
        lines += ["", "Fused MoE kernel (one layer's experts) vs the weight-read floor:", "",
                  render_moe(report["moe_kernel"])]
    if report.get("quant_kernels"):
        from benchmarks.quant_kernel_bench import render as render_quant
        lines += ["", "W8A8 INT8 GEMM and INT8 KV attention against bf16 (Llama-3.1-8B shapes):", "",
                  render_quant(report["quant_kernels"])]
    lines += ["", "| model | batch | CUDA graphs | ms/step | tok/s | weight-read floor ms | x floor |",
              "|---|---|---|---|---|---|---|"]
    for name, entry in report["models"].items():
        if "error" in entry:
            lines.append(f"| {name} | failed: {entry['error'][:200]} | | | | | |")
        for r in entry.get("decode", []):
            lines.append(f"| {name} | {r['batch']} | {r['cuda_graphs']} | {r['ms_per_step']:.2f} | "
                         f"{r['tokens_per_s']:.0f} | {r['weight_read_floor_ms']:.2f} | {r['x_of_floor']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
