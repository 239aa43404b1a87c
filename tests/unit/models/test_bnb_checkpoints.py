"""bitsandbytes 4-bit checkpoints (NF4 with double quant, FP4 without), packed as
bitsandbytes packs them (tests/helpers/bnb_checkpoints.py): the engine's 4-bit layout
dequantizes exactly to the format's reference, the W4A16 kernel with the code table
matches it, and for NF4 the weights stay packed in the model and greedy tokens equal
transformers' on the dequantized weights (chunked prefill), logprobs within 1e-3 (fp32)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.models import bnb_format, int_formats
from backend.models.int_linear import IntLinear
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers import bnb_checkpoints as bc
from tests.helpers.checkpoints import check_against_model, make_checkpoint
from tests.helpers.kernel_device import on_kernel_device

MAX_NEW = 8


def reference_weights(path: str) -> dict[str, torch.Tensor]:
    state = load_file(os.path.join(path, "model.safetensors"))
    names = sorted({k.split(".weight.quant_state")[0] for k in state if ".weight.quant_state." in k})
    return {n: bnb_format.dequantize_4bit(state[f"{n}.weight"], bnb_format.pop_quant_state(dict(state), n))
            for n in names}


def test_nf4_and_fp4_checkpoints_load_and_decode_as_transformers(ckpt_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from backend.ops.int_gemm_triton import int_gemm
    base = make_checkpoint(str(ckpt_dir / "llama-int"), "llama", hidden_size=128, intermediate_size=256)
    prompts = random_prompts(3, [1, 37, 9], seed=5)
    params = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0, logprobs=3)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0))
    base_state = load_file(os.path.join(base, "model.safetensors"))
    for quant_type, double_quant in (("nf4", True), ("fp4", False)):
        path = bc.write_bnb(base, str(tmp_path / quant_type), quant_type, double_quant)
        quant = json.load(open(os.path.join(path, "config.json")))["quantization_config"]
        scheme = int_formats.scheme_of(quant)
        state = load_file(os.path.join(path, "model.safetensors"))
        assert state["model.layers.0.mlp.down_proj.weight"].dtype == torch.uint8
        want = reference_weights(path)
        for name, w in want.items():
            got = int_formats.read_projection(dict(state), name, scheme)
            assert torch.equal(int_formats.dequantize(got, 4), w), name
            # Independent of the reader: the dequantized weight is the source's within 4-bit
            # error (measured ~0.09 NF4, ~0.12 FP4; a nibble or block mix-up gives ~1.4).
            source = base_state[f"{name}.weight"]
            assert (w - source).norm() / source.norm() < 0.2, name
        # The kernel (interpreter on CPU) looks the codes up in the table.
        w = int_formats.read_projection(dict(state), "model.layers.1.mlp.gate_proj", scheme)
        torch.testing.assert_close(on_kernel_device(int_gemm)(x, w.qweight, w.scales, w.zeros, w.g_idx, 4, quant_map=w.quant_map),
                                   x @ want["model.layers.1.mlp.gate_proj"].t(), rtol=1e-4, atol=1e-4)
        if quant_type == "fp4":
            continue        # the engine path differs only by the table: decoded for NF4 (CI time)

        llm = LLM(path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
        qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, IntLinear) and qkv.qweight.dtype == torch.int32
        assert qkv.qweight.numel() == qkv.in_features * qkv.out_features // 8      # 4 bits a weight
        assert qkv.zeros is None and qkv.scales.shape == (qkv.in_features // 64, qkv.out_features)
        # The fused q/k/v through the kernel (what CUDA runs) equals the CPU path's dequantized matmul.
        # (On a GPU host the engine's weights are on CUDA: the dequantized matmul spelled out.)
        h = torch.randn(3, qkv.in_features, generator=torch.Generator().manual_seed(1)).to(qkv.qweight.device)
        dequantized = int_formats.dequantize(qkv.weight_only(), qkv.bits, qkv.part_sizes).to(h.dtype)
        matmul = torch.nn.functional.linear(h, dequantized, qkv.bias)
        qkv.use_kernel = True
        torch.testing.assert_close(qkv(h), matmul, rtol=1e-4, atol=1e-4)
        qkv.use_kernel = False
        outs = llm.generate(prompts, params)
        ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        named = dict(ref.named_parameters())
        with torch.no_grad():
            for name, w in want.items():
                named[f"{name}.weight"].copy_(w)
        worst = check_against_model(ref, prompts, outs, MAX_NEW)
        assert worst < 1e-3, (quant_type, worst)
        assert_pool_free(llm)

    with pytest.raises(int_formats.IntFormatError, match="load_in_8bit"):
        int_formats.scheme_of({"quant_method": "bitsandbytes", "load_in_8bit": True})
    with pytest.raises(int_formats.IntFormatError, match="bnb_4bit_quant_type"):
        int_formats.scheme_of({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"})


def test_transcription_matches_bitsandbytes_where_it_imports():
    """With bitsandbytes importable (its CPU backend; not a CI dependency), the helper's
    packing writes its bytes and the engine's reference dequantizes its serialized state
    exactly as its dequantize_4bit does, NF4/FP4, double quant or not, fp32/bf16."""
    functional = pytest.importorskip("bitsandbytes.functional")
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for quant_type in ("nf4", "fp4"):
            for double_quant in (True, False):
                w = (torch.randn(96, 128) * 0.3).to(dtype)
                q, qs = functional.quantize_4bit(w, blocksize=64, quant_type=quant_type,
                                                 compress_statistics=double_quant)
                mine = bc.quantize_4bit(w, quant_type, double_quant=double_quant)
                assert torch.equal(q, mine[""]) and torch.equal(qs.code, mine[".quant_map"])
                state = {f"p.weight.{k}": v for k, v in qs.as_dict(packed=True).items()}
                state["p.weight"] = q
                ours = bnb_format.dequantize_4bit(q, bnb_format.pop_quant_state(state, "p"))
                assert torch.equal(ours, functional.dequantize_4bit(q, qs))
