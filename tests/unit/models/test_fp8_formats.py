"""FP8 beyond static per-tensor activations: dynamic per-token activation scales (our
`builder build --weights fp8 --activation-scheme dynamic`, and `quant_method: fp8`
checkpoints as vLLM/AutoFP8 write them), and block-wise FP8 (`weight_block_size`,
`weight_scale_inv` per block, as DeepSeek-V3 and Qwen3-FP8 ship). The engine's greedy
tokens equal transformers' on the same dequantized weights with the same activation
rounding (block-wise: transformers' own FineGrainedFP8 dequantization)."""

import json
import os

import pytest
import torch

from backend.models.config import UnsupportedModelError, load_model_config
from backend.models.fp8_formats import (FP8FormatError, FP8Scheme, dequantize_block, fp8_state_dict,
                                        per_group_fake_quantize)
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers import quant_checkpoints as qc
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.kernel_device import KERNEL_DEVICE, on_kernel_device

PROMPTS = random_prompts(3, [1, 21, 9], seed=7)


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama-fp8-formats"), "llama")


def _agrees(path, ref, **kw):
    # Activation rounding is discontinuous: an input 1e-7 from a rounding boundary may land
    # on the other E4M3 neighbour in one of the two (a few 1e-2 in logprobs); the other
    # prompts agree to 1e-6, and unrounded activations change tokens. On CPU: an H100's FP8
    # GEMMs accumulate with fewer bits than fp32 (test_fp8_linear.py checks CUDA's).
    tokens, gaps = qc.assert_engine_matches(path, ref, PROMPTS, tol=0.05, device="cpu", **kw)
    assert min(gaps) < 1e-4, gaps
    return tokens


def test_block_fp8_checkpoint_equals_transformers_finegrained_fp8(base, tmp_path):
    # Non-square blocks that divide every projection (transformers' dequantizer needs that).
    path = qc.write_fp8(base, str(tmp_path / "block"), (16, 32))
    assert load_model_config(path).quantization["weight_block_size"] == [16, 32]
    tokens = _agrees(path, qc.fp8_block_reference(path, 32))
    # The Triton block-FP8 GEMM in the engine (interpreter): the same tokens.
    from backend import LLM, SamplingParams
    llm = LLM(path, block_size=4, num_kv_blocks=64, attention_backend="triton")
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, temperature=0))[0].token_ids == tokens[0][:4]
    assert_pool_free(llm)
    # The exported graphs have static FP8 Q/DQ only: refused before anything is written.
    from builder.build import BuildError, BuildOptions, build
    with pytest.raises(BuildError, match="'engine': onnxruntime exports static FP8 Q/DQ graphs only; the checkpoint "
                                         "is fp8 FP8 block-wise dynamic"):
        build(BuildOptions.create(checkpoint=path, output=str(tmp_path / "onnx"), engine="onnxruntime"),
              progress=False)


def test_triton_block_fp8_gemm_equals_the_reference():
    from backend.ops.fp8_block_gemm_triton import fp8_block_gemm
    g = torch.Generator().manual_seed(0)
    for M, N, K, bk, bias in ((5, 96, 150, 32, True), (33, 70, 256, 128, False)):    # ragged K, M, N
        x = torch.randn(M, K, generator=g) * 3
        w = (torch.randn(N, K, generator=g) * 50).to(torch.float8_e4m3fn)
        ws = torch.rand(N, -(-K // bk), generator=g) / 100
        b = torch.randn(N, generator=g) if bias else None
        want = torch.nn.functional.linear(per_group_fake_quantize(x, bk), dequantize_block(w, ws, bk), b)
        # Hopper's FP8 tensor cores accumulate each K step with fewer bits than fp32 (the
        # kernel promotes per step, as DeepSeek-V3's): 6.6e-3 absolute on an H100, 1-2e-4 of the
        # output's largest value (37 and 65 here).
        tol = (dict(rtol=1e-5, atol=1e-4) if KERNEL_DEVICE.type == "cpu"
               else dict(rtol=0, atol=1e-3 * want.abs().max().item()))
        torch.testing.assert_close(on_kernel_device(fp8_block_gemm)(x, w, ws, bk, b), want, **tol)


def test_block_scales_ragged_edges_and_errors(base, tmp_path):
    g = torch.Generator().manual_seed(1)
    N, K, bn, bk = 50, 70, 16, 32                       # partial blocks along both dims
    q = (torch.randn(N, K, generator=g) * 40).to(torch.float8_e4m3fn)
    inv = torch.rand(4, 3, generator=g)
    name = "model.layers.0.mlp.down_proj"
    state = fp8_state_dict({f"{name}.weight": q, f"{name}.weight_scale_inv": inv}, 1, FP8Scheme("fp8", True, (bn, bk)))
    want = torch.tensor([[q[n, k].float().item() * inv[n // bn, k // bk].item() for k in range(K)] for n in range(N)])
    assert torch.equal(dequantize_block(state[f"{name}.weight"], state[f"{name}.weight_scale"], bk), want)
    x = torch.randn(3, K, generator=g) * 5
    groups = [qc.per_group_fp8(x[:, a:a + bk].shape[1])(x[:, a:a + bk]) for a in range(0, K, bk)]
    assert torch.equal(per_group_fake_quantize(x, bk), torch.cat(groups, 1))
    with pytest.raises(FP8FormatError, match=r"'model.layers.0.mlp.down_proj.weight_scale_inv' should be \[4, 3\]"):
        fp8_state_dict({f"{name}.weight": q, f"{name}.weight_scale_inv": inv[:3]}, 1, FP8Scheme("fp8", True, (bn, bk)))
    path = str(tmp_path / "cfg")
    os.makedirs(path)
    cfg = json.load(open(os.path.join(base, "config.json")))
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(UnsupportedModelError, match="weight_block_size needs activation_scheme 'dynamic'"):
        load_model_config(path)


def test_dynamic_fp8_build_and_checkpoints_equal_transformers(base, tmp_path):
    from builder.entry_files import write_fp8_checkpoint
    from builder.fp8 import default_texts, quantize_checkpoint
    calib, held = default_texts()
    state, qcfg, _ = quantize_checkpoint(base, calib[:4], held[:2], lambda name, n: lambda k=1: None, "dynamic")
    assert qcfg["activation_scheme"] == "dynamic" and not any(k.endswith("input_scale") for k in state)
    built = str(tmp_path / "built")
    write_fp8_checkpoint(base, built, state, qcfg)
    _agrees(built, qc.fp8_per_channel_reference(base, built))
    # vLLM / AutoFP8 `quant_method: fp8`, one weight scale per tensor: dynamic, and static.
    path = qc.write_fp8(base, str(tmp_path / "per-tensor"), None)
    _agrees(path, qc.fp8_per_channel_reference(base, path))
    path = qc.write_fp8(base, str(tmp_path / "static"), None, static=True)
    _agrees(path, qc.fp8_per_channel_reference(base, path, qc.STATIC_INPUT_SCALE))
