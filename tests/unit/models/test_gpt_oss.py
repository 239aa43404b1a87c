"""gpt-oss: its config read as transformers reads it, YaRN tables equal to transformers',
the Triton kernels (sinks, biased clamped-SwiGLU experts) in the engine against
transformers, and an MXFP4 checkpoint packed as published, dequantized exactly and
decoded as transformers decodes the dequantized weights. (Greedy = transformers with the
torch path, chunked prefill, preemption and prefix hits: tests/unit/engine/
test_moe_exactness.py, which runs every family of MOE_ARCHS.)"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLM, SamplingParams
from backend.ops import mxfp4
from backend.models.config import UnsupportedModelError, model_config_from_dict
from backend.models.rotary import RotaryEmbedding, inverse_frequencies
from backend.parallel.sharding import check_tensor_parallel
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.kernel_device import on_kernel_device
from tests.helpers.moe_checkpoints import make_moe_checkpoint
from tests.helpers.mxfp4_pack import pack_mxfp4, unpack_mxfp4
from tests.helpers.pins import require_pinned

# gpt-oss-20b's config.json as published (dimensions cut down), MXFP4 experts.
PUBLISHED = {"architectures": ["GptOssForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "num_local_experts": 8, "num_experts_per_tok": 4, "sliding_window": 128, "rope_theta": 150000,
             "max_position_embeddings": 131072, "experts_per_token": 4, "swiglu_limit": 7.0,
             "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                              "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
             "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"],
                                     "quant_method": "mxfp4"}}


def test_config_as_published():
    cfg = model_config_from_dict(PUBLISHED)
    assert cfg.family == "gpt_oss" and cfg.attention_sinks and cfg.mxfp4_experts and cfg.quantization is None
    assert cfg.sliding_windows == (128, None, 128, None)            # layer_types' default: sliding first
    assert cfg.qkv_bias and cfg.o_bias                               # attention_bias defaults to true
    assert cfg.rope_scaling["rope_type"] == "yarn" and not cfg.rope_scaling["truncate"]
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.activation, moe.swiglu_limit) == (8, 4, "swigluoai", 7.0)
    assert moe.router_bias and moe.expert_bias and moe.softmax_after_topk and all(moe.sparse_layers)
    assert check_tensor_parallel(cfg, 2) is None                      # 32 channels a rank: whole scale groups
    assert "enable_expert_parallel" in check_tensor_parallel(cfg, 4)   # 16 would cut one
    llama = {**PUBLISHED, "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(UnsupportedModelError, match="mxfp4"):
        model_config_from_dict(llama)


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096, truncate=False),
    dict(factor=4.0, original_max_position_embeddings=64),                       # truncated, default betas
    dict(factor=8.0, original_max_position_embeddings=256, mscale=0.707, mscale_all_dim=1.0, beta_fast=16),
])
def test_yarn_tables_equal_transformers(params):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    hf_cfg = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=dict(rope))
    inv_freq, attention = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    cfg = model_config_from_dict({**PUBLISHED, "quantization_config": None, "rope_scaling": None,
                                  "rope_parameters": rope})
    ours = inverse_frequencies(16, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(ours, inv_freq.float())
    assert cfg.rope_scaling["attention_factor"] == pytest.approx(attention, rel=1e-12)
    table = RotaryEmbedding(16, 8, cfg.rope_theta, cfg.rope_scaling)
    freqs = torch.arange(8, dtype=torch.float32)[:, None] * inv_freq[None, :]
    assert torch.equal(table.cos_cache[:, :8], freqs.cos() * attention)


def test_triton_kernels_match_transformers(ckpt_dir):
    """attention_backend="triton" under the interpreter on the MXFP4 checkpoint: both
    attention kernels with sinks and the window (12 < the 20-token prompt), the routing
    kernel, the fused MoE kernel with biases and the clamped SwiGLU reading the experts
    still packed (decoded in its tiles); chunked prefill and preemption."""
    require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    grid, packed = make_mxfp4_pair(str(ckpt_dir))
    prompts = random_prompts(3, [1, 20, 9], seed=5)
    expected = hf_greedy(grid, prompts, 4)
    # Three blocks of 8 hold the longest sequence alone: the others are preempted.
    llm = LLM(packed, block_size=8, num_kv_blocks=3, max_num_seqs=8, max_num_batched_tokens=16,
              attention_backend="triton")
    experts = llm.engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.uint8 and experts.gate_up_proj_scale is not None
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, min_tokens=4, temperature=0))
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert_pool_free(llm)


def test_mxfp4_decoding_is_exact(monkeypatch):
    """Every byte (both nibbles) under scales from 2^-127 to 2^127 against the spec's table
    transcription, in fp32 and bf16; 255 is NaN; shapes checked; decoding in chunks of
    rows gives the same."""
    blocks = torch.arange(256, dtype=torch.uint8).view(1, 16, 16)
    scales = torch.tensor([[0, 1, 100, 126, 127, 128, 200, 254, 3, 50, 120, 125, 129, 130, 131, 253]],
                          dtype=torch.uint8)
    got = mxfp4.dequantize(blocks, scales)
    assert got.shape == (1, 512) and torch.equal(got, unpack_mxfp4(blocks, scales))
    assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16).float(), got)    # exact in bf16 too
    assert torch.equal(mxfp4.dequantize(blocks[:, :1], torch.tensor([[127]], dtype=torch.uint8))[0, :4],
                       torch.tensor([0.0, 0.0, 0.5, 0.0]))       # byte 0x00, 0x01: low nibble first
    assert torch.isnan(mxfp4.dequantize(blocks[:, :1], torch.tensor([[255]], dtype=torch.uint8))).all()
    monkeypatch.setattr(mxfp4, "CHUNK_ROWS", 5)
    assert torch.equal(mxfp4.dequantize(blocks, scales), got)
    with pytest.raises(mxfp4.MXFP4Error, match="do not match"):
        mxfp4.dequantize(blocks, scales[:, :3])


def make_mxfp4_pair(root: str) -> tuple[str, str]:
    """(float checkpoint whose expert weights lie on the MXFP4 grid, the same model with
    its experts packed as gpt-oss publishes them)."""
    from transformers import AutoModelForCausalLM
    base = make_moe_checkpoint(os.path.join(root, "gpt_oss"), "gpt_oss")
    grid, packed = os.path.join(root, "gpt_oss_grid"), os.path.join(root, "gpt_oss_mxfp4")
    if not os.path.isdir(packed):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):   # [E, in, out]
                    p.copy_(unpack_mxfp4(*pack_mxfp4(p.transpose(1, 2))).transpose(1, 2))
        model.save_pretrained(grid)
        shutil.copytree(grid, packed)
        name = os.path.join(packed, "model.safetensors")
        state = load_file(name)
        for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            blocks, scales = pack_mxfp4(state.pop(key).transpose(1, 2))          # as published: [E, out, in]
            state[f"{key}_blocks"], state[f"{key}_scales"] = blocks.contiguous(), scales.contiguous()
        save_file(state, name, metadata={"format": "pt"})
        with open(os.path.join(packed, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = PUBLISHED["quantization_config"]
        with open(os.path.join(packed, "config.json"), "w") as f:
            json.dump(cfg, f)
    return grid, packed


def test_mxfp4_checkpoint_decodes_as_transformers_on_its_dequantized_weights(ckpt_dir):
    require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    grid, packed = make_mxfp4_pair(str(ckpt_dir))
    state, floats = load_file(os.path.join(packed, "model.safetensors")), load_file(os.path.join(grid, "model.safetensors"))
    prefix = "model.layers.0.mlp.experts"
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = state[f"{prefix}.{proj}_blocks"], state[f"{prefix}.{proj}_scales"]
        ours = mxfp4.dequantize(blocks, scales).transpose(1, 2)
        assert torch.equal(ours, floats[f"{prefix}.{proj}"])
        assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    prompts = random_prompts(3, [1, 25, 14], seed=7)
    expected = hf_greedy(grid, prompts, 10)
    llm = LLM(packed, block_size=4, num_kv_blocks=40, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, min_tokens=10, temperature=0))
    assert [o.token_ids for o in outs] == expected
    assert_pool_free(llm)



def test_bf16_norms_round_as_transformers(ckpt_dir):
    """transformers keeps gpt-oss's norm weights in fp32 and rounds after the multiply;
    the engine loads them so and both norm implementations follow (Llama's order, with a
    weight in the activation dtype, rounds twice and differs). The Triton kernel is
    checked in fp16: the interpreter's bf16 conversions do not round as a GPU's do."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from backend.ops import reference, triton_kernels
    g = torch.Generator().manual_seed(3)
    hf = GptOssRMSNorm(96, 1e-5)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(96, generator=g) * 3)
    w = hf.weight.detach()
    # Share of elements that differ from transformers': none for the reference; the
    # kernel's variance sums in another order (a rare last-bit difference); Llama's
    # order differs in about a third.
    for dtype, norm, bound in [(torch.bfloat16, reference.add_rms_norm, 0.0),
                               (torch.float16, reference.add_rms_norm, 0.0),
                               (torch.float16, on_kernel_device(triton_kernels.add_rms_norm), 0.01)]:
        x, res = torch.randn(64, 96, generator=g).to(dtype), torch.randn(64, 96, generator=g).to(dtype)
        with torch.no_grad():
            expected = hf(x + res)
        assert (norm(x, res, w, 1e-5)[0] != expected).float().mean() <= bound, (dtype, norm)
        assert (norm(x, res, w.to(dtype), 1e-5)[0] != expected).float().mean() > 0.1
    path = make_moe_checkpoint(str(ckpt_dir / "gpt_oss"), "gpt_oss")
    llm = LLM(path, dtype="bfloat16", block_size=8, num_kv_blocks=8)
    model = llm.engine.model
    assert model.model.norm.weight.dtype == torch.float32
    assert model.model.layers[1].post_attention_layernorm.weight.dtype == torch.float32
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.bfloat16


def test_mxfp4_build_serves(ckpt_dir, tmp_path):
    """`builder build` of the MXFP4 checkpoint (torch engine, float32): the entry serves
    transformers' tokens on the dequantized weights; graph engines are refused (MoE)."""
    require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    from builder.build import BuildError, BuildOptions, build
    from tests.unit.builder.test_build_moe import served
    grid, packed = make_mxfp4_pair(str(ckpt_dir))
    out = build(BuildOptions.create(checkpoint=packed, output=str(tmp_path / "e"), weights="float32",
                                    num_kv_blocks=32, block_size=8), log=lambda *_: None, progress=False)
    llm = served(out)
    prompts = [[5, 9, 13, 2, 7, 40, 41], [11, 3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
    assert [o.token_ids for o in outs] == hf_greedy(grid, prompts, 6)
    assert_pool_free(llm)
    with pytest.raises(BuildError, match="mixture-of-experts"):
        build(BuildOptions.create(checkpoint=packed, output=str(tmp_path / "o"), engine="onnxruntime"),
              log=lambda *_: None, progress=False)
