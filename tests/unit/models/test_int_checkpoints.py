"""Weight-only INT4/INT8 checkpoints (compressed-tensors pack-quantized, GPTQ, AWQ):
the engine's unpacking equals each format's reference dequantization exactly, and the
engine's greedy tokens equal transformers' on the reference-dequantized weights, with
logprobs within 1e-3 (fp32, CPU: the promise holds in fp32)."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.models import int_formats
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers import int_checkpoints as ic
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.kernel_device import on_kernel_device
from tests.helpers.quant_checkpoints import assert_engine_matches

MAX_NEW = 8
FORMATS = {
    "ct-w4-g128-sym": lambda b, p: ic.write_compressed_tensors(b, p, 4, 128, True),
    "ct-w4-g64-asym": lambda b, p: ic.write_compressed_tensors(b, p, 4, 64, False),
    "ct-w8-channel-sym": lambda b, p: ic.write_compressed_tensors(b, p, 8, -1, True),
    "ct-w8-g32-asym": lambda b, p: ic.write_compressed_tensors(b, p, 8, 32, False),
    "gptq-4-g128": lambda b, p: ic.write_gptq(b, p, 4, 128, desc_act=False),
    "gptq-4-g32-act-order": lambda b, p: ic.write_gptq(b, p, 4, 32, desc_act=True),
    "gptq-8-g64-act-order": lambda b, p: ic.write_gptq(b, p, 8, 64, desc_act=True),
    "awq-4-g64": lambda b, p: ic.write_awq(b, p, 64),
}


@pytest.fixture(scope="module")
def base(ckpt_dir):
    # Wide enough for groups of 32, 64 and 128 in every projection.
    return make_checkpoint(str(ckpt_dir / "llama-int"), "llama", hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def quantized(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("int")
    return {name: write(base, str(root / name)) for name, write in FORMATS.items()}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_unpacking_equals_the_reference_dequantization(quantized, fmt):
    from safetensors.torch import load_file
    path = quantized[fmt]
    import json
    import os
    scheme = int_formats.scheme_of(json.load(open(os.path.join(path, "config.json")))["quantization_config"])
    state = load_file(os.path.join(path, "model.safetensors"))
    for name, want in ic.reference_weights(path).items():
        got = int_formats.dequantize(int_formats.read_projection(state, name, scheme), scheme.bits)
        assert torch.equal(got, want), name


@pytest.mark.parametrize("fmt", ["ct-w4-g128-sym", "ct-w8-g32-asym", "gptq-4-g32-act-order", "awq-4-g64"])
def test_engine_equals_transformers_on_the_dequantized_weights(base, quantized, fmt):
    prompts = random_prompts(4, [1, 23, 7, 40], seed=5)
    assert_engine_matches(quantized[fmt], ic.reference_model(base, quantized[fmt]), prompts, MAX_NEW, tol=1e-3,
                          logprobs=3)


def test_triton_int_gemm_equals_the_reference(quantized):
    """The W4A16/W8A16 kernel (interpreter on CPU), act order and asymmetric zeros
    included, against dequantize + matmul."""
    import json
    import os

    from safetensors.torch import load_file

    from backend.ops.int_gemm_triton import int_gemm
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    for fmt in ("gptq-4-g32-act-order", "ct-w8-g32-asym", "awq-4-g64", "ct-w4-g64-asym"):
        path = quantized[fmt]
        scheme = int_formats.scheme_of(json.load(open(os.path.join(path, "config.json")))["quantization_config"])
        w = int_formats.read_projection(load_file(os.path.join(path, "model.safetensors")),
                                        "model.layers.0.mlp.gate_proj", scheme)
        got = on_kernel_device(int_gemm)(x, w.qweight, w.scales.float(), w.zeros, w.g_idx, scheme.bits)
        torch.testing.assert_close(got, x @ int_formats.dequantize(w, scheme.bits).t(), rtol=1e-4, atol=1e-4)


def test_triton_backend_engine_runs_the_kernel(base, quantized):
    prompts = random_prompts(2, [9, 17], seed=6)
    torch_llm = LLM(quantized["gptq-4-g128"], block_size=8, num_kv_blocks=16)
    triton_llm = LLM(quantized["gptq-4-g128"], block_size=8, num_kv_blocks=16, attention_backend="triton")
    params = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
    assert [o.token_ids for o in triton_llm.generate(prompts, params)] == \
        [o.token_ids for o in torch_llm.generate(prompts, params)]
    # GPTQ g128 without act order: every projection runs the blocked kernel, re-packed at load.
    from backend.models.int_linear import IntLinear
    layers = [m for m in triton_llm.engine.model.modules() if isinstance(m, IntLinear)]
    assert layers and all(m._blocked for m in layers)


def test_lora_adapter_on_an_int4_base(base, quantized, tmp_path):
    """An adapter over a GPTQ INT4 base (act order): transformers + PEFT on the
    reference-dequantized weights give the engine's greedy tokens."""
    from peft import PeftModel

    from tests.helpers.adapters import make_adapter
    adapter = make_adapter(base, str(tmp_path / "lora"), rank=8, targets=("q_proj", "v_proj", "down_proj"), seed=3)
    ref = PeftModel.from_pretrained(ic.reference_model(base, quantized["gptq-4-g32-act-order"]), adapter).eval()
    prompts = random_prompts(2, [5, 19], seed=8)
    llm = LLM(quantized["gptq-4-g32-act-order"], block_size=4, num_kv_blocks=32, lora_modules={"a": adapter})
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0,
                                                lora_name="a"))
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            want = ref.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                do_sample=False, attention_mask=torch.ones(1, len(p), dtype=torch.long))
            assert out.token_ids == want[0, len(p):].tolist()
    assert_pool_free(llm)
