"""W8A8 INT8 (SmoothQuant, per-channel INT8 weights, dynamic per-token INT8 activations):
the builder's smoothing is folded into the norms and pays off on outlier channels, its
compressed-tensors `int-quantized` checkpoint serves with transformers' greedy tokens on
the same fake-quantized numerics (fp32, logprobs within 1e-3), and the Triton INT8 GEMM
equals the exact torch reference (interpreter; its sm_90 compile is in
tests/unit/ops/test_sm90_compile.py)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend.models.config import UnsupportedModelError, load_model_config
from builder.build import BuildError, BuildOptions, build
from builder.fp8 import default_texts
from builder.w8a8 import DEFAULT_ALPHA
from tests.conftest import random_prompts
from tests.helpers import quant_checkpoints as qc
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.kernel_device import KERNEL_DEVICE, on_kernel_device

OUTLIERS = [3, 17, 40]          # input channels the norms blow up: what SmoothQuant is for


@pytest.fixture(scope="module")
def outlier_base(ckpt_dir):
    """The tiny Qwen2 (q/k/v bias, tied head) with a few norm channels 10x larger, as
    trained LLMs have them."""
    base = make_checkpoint(str(ckpt_dir / "qwen2-w8a8"), "qwen2")
    path = str(ckpt_dir / "qwen2-w8a8-outliers")
    if not os.path.isdir(path):
        shutil.copytree(base, path)
        state = load_file(os.path.join(path, "model.safetensors"))
        for k in state:
            if k.endswith("layernorm.weight"):
                state[k][OUTLIERS] *= 10
        save_file(state, os.path.join(path, "model.safetensors"))
    return path


def _texts():
    calib, held = default_texts()
    return calib[:4], held[:2]          # a few paragraphs: the tiny model needs no more


def test_w8a8_build_smooths_and_serves_transformers_fake_quant_tokens(outlier_base, tmp_path, monkeypatch):
    from builder.__main__ import main
    monkeypatch.setattr("builder.fp8.default_texts", _texts)
    assert main(["build", "--checkpoint", outlier_base, "--output", str(tmp_path / "entry"), "--weights", "w8a8",
                 "--smoothquant-alpha", "0.5", "--num-kv-blocks", "64"]) == 0
    manifest = json.load(open(tmp_path / "entry" / "build_manifest.json"))
    report = manifest["quality"]
    # fp32 source: the projections shrink 4x, the (tied) embedding stays.
    assert manifest["memory_plan"]["weight_bytes"] < 0.5 * os.path.getsize(os.path.join(outlier_base,
                                                                                        "model.safetensors"))
    path = str(tmp_path / "entry" / "checkpoint")
    quant = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
    group = quant["config_groups"]["group_0"]
    assert quant["format"] == "int-quantized" and group["weights"]["strategy"] == "channel"
    assert group["input_activations"] == {**group["input_activations"], "dynamic": True, "strategy": "token"}
    state = load_file(os.path.join(path, "model.safetensors"))
    assert state["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    # Smoothing went into the norms: the outlier channels shrank.
    src = load_file(os.path.join(outlier_base, "model.safetensors"))
    norm = "model.layers.1.post_attention_layernorm.weight"
    assert (state[norm][OUTLIERS] < src[norm][OUTLIERS] / 2).all()

    # ... and it pays: without it, per-token INT8 rounds the outliers' tokens worse (measured:
    # relative logit error 0.20 unsmoothed, 0.11 smoothed; 0.053 and 0.051 without the outliers).
    monkeypatch.setattr("builder.w8a8.smooth", lambda model, batches, alpha: None)
    build(BuildOptions.create(checkpoint=outlier_base, output=str(tmp_path / "plain"), weights="w8a8",
                              smoothquant_alpha=DEFAULT_ALPHA, num_kv_blocks=64), log=lambda *_: None, progress=False)
    plain = json.load(open(tmp_path / "plain" / "build_manifest.json"))["quality"]
    assert report["relative_logit_error"] < 0.75 * plain["relative_logit_error"], (report, plain)

    # Per-token rounding is discontinuous: where the engine's and transformers' fp32 inputs
    # (1e-7 apart) straddle a rounding boundary, one activation moves by a step, which on
    # these outlier-sized scales shifts logprobs by up to ~0.03 (prompt 2 here); other
    # prompts agree to 1e-6. Unrounded activations miss by 0.07 to 9 and change tokens.
    prompts = random_prompts(3, [1, 21, 9], seed=4)
    tokens, gaps = qc.assert_engine_matches(path, qc.w8a8_reference(outlier_base, path), prompts, tol=0.05)
    assert min(gaps) < 1e-4, gaps
    # The Triton GEMM in the engine (interpreter) gives the same tokens.
    got, _ = qc.assert_engine_matches(path, qc.w8a8_reference(outlier_base, path), prompts[:1], max_new=4,
                                      tol=1e-4, attention_backend="triton")
    assert got == [tokens[0][:4]]
    # A LoRA adapter on top: PEFT over the same reference gives the engine's tokens.
    from tests.helpers.adapters import make_adapter
    adapter = make_adapter(outlier_base, str(tmp_path / "lora"), rank=8, targets=("q_proj", "v_proj", "down_proj"),
                           seed=3)
    qc.assert_engine_matches(path, qc.w8a8_lora_reference(outlier_base, path, adapter), prompts[1:], tol=0.05,
                             lora_modules={"a": adapter}, lora_name="a")


def test_triton_w8a8_gemm_equals_the_exact_reference():
    from backend.models.w8a8 import int8_gemm_reference, quantize_per_token
    from backend.ops.w8a8_gemm_triton import w8a8_gemm
    g = torch.Generator().manual_seed(0)
    for M, N, K, bias in ((5, 96, 160, True), (33, 70, 64, False)):     # ragged tiles both ways
        x = torch.randn(M, K, generator=g) * torch.rand(K, generator=g) * 10
        wq = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        ws = torch.rand(N, generator=g) / 100
        b = torch.randn(N, generator=g) if bias else None
        xq, xs = quantize_per_token(x)
        want = int8_gemm_reference(xq, xs, wq, ws, b, torch.float32)
        # A GPU contracts the scales and bias into FMAs (a last-bit difference, 5e-6 seen on an H100).
        rtol = 1e-6 if KERNEL_DEVICE.type == "cpu" else 1e-5
        got = on_kernel_device(w8a8_gemm)(xq, xs, wq, ws, b, torch.float32, split_k=1)
        torch.testing.assert_close(got, want, rtol=rtol, atol=0)
        # K split (as decode sizes are): each split scales its own int32 sum, the bias goes
        # once, the fp32 partials are summed: within fp32's rounding of the sum.
        for split_k in (None, 2):
            split = on_kernel_device(w8a8_gemm)(xq, xs, wq, ws, b, torch.float32, split_k=split_k)
            torch.testing.assert_close(split, want, rtol=1e-5, atol=1e-5)
        # The reference is the integer product: against a float64 dot of the dequantized values.
        exact = (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).t()
        torch.testing.assert_close(want.double(), exact + (0 if b is None else b.double()), rtol=1e-5, atol=1e-5)
    # The integer accumulator itself is exact where fp32 sums are not (K * 2^14 > 2^24):
    # every int32 sum equals Python's integer dot, the extremes included.
    from backend.models.w8a8 import int8_matmul_exact
    xq = torch.randint(-128, 128, (3, 4096), generator=g, dtype=torch.int8)
    wq = torch.randint(-128, 128, (5, 4096), generator=g, dtype=torch.int8)
    xq[0], wq[0], xq[1], wq[1, ::3] = -128, -128, 127, 127     # sums near 2^26, odd steps: fp32 rounds them
    got = int8_matmul_exact(xq, wq)
    assert got.dtype == torch.int32 and int(got[0, 0]) == 4096 * 128 * 128
    assert got.tolist() == [[sum(a * b for a, b in zip(r, c)) for c in wq.tolist()] for r in xq.tolist()]


def test_unsupported_w8a8_variants_and_options_name_the_field(outlier_base, tmp_path):
    path = str(tmp_path / "cfg")
    os.makedirs(path)
    cfg = json.load(open(os.path.join(outlier_base, "config.json")))
    group = {"weights": {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "channel"},
             "input_activations": {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "tensor",
                                   "dynamic": False}}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "int-quantized",
                                  "config_groups": {"group_0": group}}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(UnsupportedModelError, match=r"input_activations.dynamic is False, supported is True"):
        load_model_config(path)
    for bad, match in (({"weights": "int8", "activation_scheme": "dynamic"}, "activation_scheme=dynamic is for"),
                       ({"weights": "fp8", "smoothquant_alpha": 0.8}, "smoothquant_alpha is for weights w8a8"),
                       ({"weights": "w8a8", "smoothquant_alpha": 1.5}, "smoothquant_alpha"),
                       ({"weights": "w8a8", "engine": "onnxruntime"}, "run with engine torch")):
        with pytest.raises(BuildError, match=match):
            BuildOptions.create(checkpoint=outlier_base, output=str(tmp_path / "x"), **bad)
