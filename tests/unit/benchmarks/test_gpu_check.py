"""benchmarks/gpu_check.py's stages on CPU with the default model, so that a GPU session
spends its minutes measuring, not fixing the script: sampled requests, the nano-vllm
workload (scaled down), decode benchmarks and the report. Only the CUDA calls are
stood in for (torch.cuda.synchronize) and the engine is placed on the CPU."""

import torch

from backend import LLM
from benchmarks import gpu_check


def test_gpu_check_stages_run_and_report(tiny_ckpt, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))

    def cpu_llm(path, **kw):
        kw.update(device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=256)
        return LLM(path, **kw)
    monkeypatch.setattr(gpu_check, "_llm", cpu_llm)
    sampled = gpu_check.sampled_requests(tiny_ckpt)
    assert sampled["completed"] and sampled["seeded_alone_equals_in_batch"]
    structured = gpu_check.structured_requests(str(tmp_path))
    assert structured == {"json_outputs_parsed": "8/8", "logit_bias_token_wins": True}
    spec = gpu_check.speculative_requests(str(tmp_path), [
        "--tokens", "16", "--repeats", "1", "--hidden", "64", "--layers", "2", "--heads", "4", "--vocab", "320",
        "--window", "8", "--configs", "off", "ngram k=4"])
    for name in ("ngram", "draft_model", "eagle3", "medusa"):   # fp32 on CPU: exact
        assert spec[name]["greedy_tokens_equal"] == spec[name]["greedy_tokens"] and spec[name]["sampled_completed"]
    assert spec["draft_model"]["acceptance_rate"] == 1.0
    assert spec["draft_model"]["draft_graphs_captured"] == 0 and "draft_graphs_captured" not in spec["ngram"]  # (CPU)
    assert {r["config"] for r in spec["bench_spec"]} == {"off", "ngram k=4"}
    eagle = gpu_check.eagle_step(["--shape", "tiny", "--batch", "1", "--k", "2", "--trees", "tree4", "--tokens", "6",
                                  "--repeats", "1"])
    assert [r["config"] for r in eagle] == ["off", "k2", "tree4"] and all(r["projected_speedup"] > 0 for r in eagle[1:])
    # The vision stage's checkpoint maker and benchmark, at tiny shapes on the CPU.
    text = dict(gpu_check.QWEN2_5_VL_7B_TEXT, vocab_size=320, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
    tower = dict(gpu_check.QWEN2_5_VL_7B_VISION, depth=2, hidden_size=32, intermediate_size=48, num_heads=4,
                 out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
    vision = gpu_check.vision(str(tmp_path), ["--device", "cpu", "--image-size", "112", "--requests", "2",
                                              "--tokens", "4", "--repeats", "1"],
                              layers=2, device="cpu", dtype=torch.float32, text=text, vision=tower)
    assert vision["outputs_differing"] == 0 and vision["encoder_cache"]["repeated"]["images_encoded"] == 1
    nano = gpu_check.nano_vllm_workload(tiny_ckpt, num_seqs=3, lo=4, hi=9)
    assert nano["output_tokens"] > 0 and nano["output_tok_per_s"] > 0
    prof = gpu_check.decode_profile(tiny_ckpt, num_seqs=3, prompt_len=5, steps=2, top=4)
    assert prof["wall_ms_per_step"] > 0 and prof["op_ms_per_step"] > 0 and 0 < len(prof["top"]) <= 4
    assert all(k["ms_per_step"] > 0 for k in prof["top"])
    rows = gpu_check.decode_benchmarks(tiny_ckpt, [1, 2], enforce_eager=False, prompt_len=6, new_tokens=3)
    assert [r["batch"] for r in rows] == [1, 2] and all(r["decode_steps"] == 2 for r in rows)
    for r in rows:
        r["weight_read_floor_ms"] = r["x_of_floor"] = 1.0
    report = {"gpu": "cpu", "torch": torch.__version__, "date": "today", "command": "x", "unit_tests": "skipped",
              "copy_bandwidth_gbs": 1.0, "structured_output": structured, "models": {"llama-3.2-1b": {"sampled_requests": sampled,
                                                                     "nano_vllm_workload": nano, "decode_profile": prof,
                                                                     "decode": rows}}}
    text = gpu_check.render(report)
    assert "nano-vllm workload" in text and "| llama-3.2-1b | 2 |" in text and "logit_bias_token_wins" in text
    assert "top kernels (ms/step)" in text


def test_attention_bench_runs_and_kernels_agree():
    """The attention benchmark's code path on tiny shapes (interpreter): every kernel runs,
    and in fp32 they agree with each other."""
    from benchmarks import attention_bench
    rows = attention_bench.run(100.0, torch.device("cpu"), shapes=[("decode", 3, 20, 1), ("prefill", 2, 0, 17)],
                               heads=8, kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32, iters=1)
    assert [r["shape"] for r in rows] == ["decode"] * 3 + ["prefill"] * 2
    assert all(r["max_abs_diff_vs_first"] < 1e-4 and r["ms"] > 0 and r["floor_ms"] > 0 for r in rows)
    assert "x floor" in attention_bench.render(rows)


def test_moe_kernel_bench_runs_and_mxfp4_agrees():
    """The fused MoE benchmark's code path on tiny shapes (interpreter): Mixtral- and
    gpt-oss-style layers and MXFP4 experts, whose output in fp32 equals the kernel's on
    the same dequantized weights; the report's table and a failed model's row."""
    from benchmarks import moe_kernel_bench
    shapes = [("mixtral", 4, 2, 64, 64, False, False), ("gpt-oss mxfp4", 4, 2, 64, 64, True, True)]
    rows = moe_kernel_bench.run(100.0, torch.device("cpu"), shapes=shapes, batches=[1, 8], dtype=torch.float32,
                                iters=1)
    assert [(r["shape"], r["batch"]) for r in rows] == [(s[0], b) for s in shapes for b in (1, 8)]
    assert all(r["ms"] > 0 and r["floor_ms"] > 0 and 1 <= r["experts_read"] <= 4 for r in rows)
    assert [r["max_abs_diff_vs_bf16"] for r in rows[2:]] == [0.0, 0.0]
    report = {"gpu": "cpu", "torch": "t", "date": "d", "command": "x", "unit_tests": "skipped",
              "copy_bandwidth_gbs": 1.0, "moe_kernel": rows, "models": {"mixtral-8x7b-2l": {"error": "boom"}}}
    text = gpu_check.render(report)
    assert "| gpt-oss mxfp4 | 8 |" in text and "| mixtral-8x7b-2l | failed: boom |" in text


def test_quant_kernel_bench_runs_and_agrees():
    """Issue 33's and 50's GPU stage (W8A8 and INT4 GEMMs and INT8 KV attention against
    bf16) on tiny shapes through the interpreter: the W8A8 kernel equals the exact integer
    reference, the blocked INT4 kernel the dequantized weights, the INT8 pool's attention
    is close to the bf16 pool's, and the report renders the tables."""
    from benchmarks import quant_kernel_bench
    report = quant_kernel_bench.run(100.0, torch.device("cpu"), gemm_shapes=[("tiny", 3, 64, 32)],
                                    kv_shapes=[("tiny", 2, 40)], int4_shapes=[("tiny int4", 2, 256, 64)],
                                    int4_splits=(1, 2), dtype=torch.float32, iters=1)
    (gemm,), (kv,), (int4,), (fp8,) = report["w8a8"], report["int8_kv"], report["int4"], report["fp8"]
    assert fp8["max_rel_diff"] < 0.1 and fp8["fp8_ms"] > 0     # (the activations' FP8 rounding, emulated on CPU)
    assert int4["max_rel_diff"] < 1e-5 and int4["best_split"] in (1, 2) and int4["floor_ms"] > 0
    assert int4["bf16_ms"] > 0 and int4["gather_ms"] > 0 and int4["blocked_ms"] > 0
    assert gemm["max_rel_diff"] < 1e-5 and gemm["bf16_ms"] > 0 and gemm["w8a8_ms"] > 0
    assert kv["max_abs_diff_vs_bf16"] < 0.05 and kv["int8_floor_ms"] == kv["bf16_floor_ms"] / 2
    text = gpu_check.render({"gpu": "cpu", "torch": "t", "date": "d", "command": "x", "unit_tests": "skipped",
                             "copy_bandwidth_gbs": 1.0, "quant_kernels": report, "models": {}})
    assert "| tiny | " in text and "INT8 KV attention" in text and "| tiny int4 | " in text and "FP8 GEMM" in text
