"""oneDNN pre-packed fp32 linears on the CPU (backend/models/cpu_packed_linear.py): the
engine packs the dense projections and the LM head (the base layers under LoRA), outputs
stay transformers' (and PEFT's) greedy tokens, and the engine's weight bytes are
unchanged."""

import gc
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from backend import LLM, SamplingParams
from backend.models import cpu_packed_linear
from backend.models.cpu_packed_linear import PackedLinear, own_remaining_weights, pack_cpu_linears
from backend.parallel.rank_spec import model_bytes
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint

pytestmark = pytest.mark.skipif(not cpu_packed_linear.available(), reason="torch built without oneDNN")


def test_a_packed_linear_computes_the_linear():
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True)
    packed = PackedLinear(lin)
    for rows in (1, 5, 33):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_results_do_not_depend_on_max_num_seqs(llama_ckpt):
    """Engines of different max_num_seqs pack the same layout, so one request's logprobs
    are equal to the bit (an offline engine and the server must agree)."""
    outs = []
    for seqs in (4, 256):
        llm = LLM(llama_ckpt, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_seqs=seqs)
        outs.append(llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0])
        assert_pool_free(llm)
    assert outs[0].token_ids == outs[1].token_ids
    assert [{t: lp.logprob for t, lp in e.items()} for e in outs[0].logprobs] == \
        [{t: lp.logprob for t, lp in e.items()} for e in outs[1].logprobs]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])        # qwen2: q/k/v bias, tied embeddings
def test_engine_packs_its_projections_and_keeps_transformers_tokens(ckpt_dir, arch):
    path = make_checkpoint(str(ckpt_dir / arch), arch)
    prompts = random_prompts(4, [3, 17, 9, 30], seed=2)
    expected = hf_greedy(path, prompts, 8)
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)
    model = llm.engine.model
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * model.config.num_layers + 1 and isinstance(model.lm_head, PackedLinear)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
    assert [o.token_ids for o in outs] == expected
    assert_pool_free(llm)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_no_weight_keeps_the_checkpoint_file_mapped(ckpt_dir, tmp_path):
    """safetensors loads CPU tensors as views of the file's mapping, which stays while any
    of them does: the engine copies what packing left, and the mapping goes."""
    path = str(shutil.copytree(make_checkpoint(str(ckpt_dir / "qwen2"), "qwen2"), tmp_path / "ckpt"))
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, num_kv_blocks=16)
    gc.collect()
    with open("/proc/self/maps") as f:
        assert not [line for line in f if path in line]
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_only_mapped_weights_are_copied_and_ties_hold(tmp_path):
    from safetensors.torch import load_file, save_file
    save_file({"emb": torch.randn(10, 4), "table": torch.arange(3.0)}, str(tmp_path / "w.safetensors"))
    loaded = load_file(str(tmp_path / "w.safetensors"))
    emb, head, norm = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(4, 4)
    emb.weight = nn.Parameter(loaded["emb"], requires_grad=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "norm": norm})
    model.register_buffer("table", loaded["table"])
    before, ptr, own = emb.weight.detach().clone(), emb.weight.data_ptr(), norm.weight
    del loaded
    assert own_remaining_weights(model) == 10 * 4 * 4 + 3 * 4      # the mapped ones only
    assert model["emb"].weight is model["head"].weight and isinstance(model["emb"].weight, nn.Parameter)
    assert model["emb"].weight.data_ptr() != ptr and torch.equal(model["emb"].weight, before)
    assert torch.equal(model.table, torch.arange(3.0)) and model["norm"].weight is own
    gc.collect()
    with open("/proc/self/maps") as f:
        assert not [line for line in f if str(tmp_path) in line]


def test_weight_bytes_are_counted_as_before(ckpt_dir):
    from backend.models.config import load_model_config
    from backend.models.loader import load_model
    from backend.attention import make_attention_factory
    from backend.ops import make_layer_ops
    for arch in ("llama", "qwen2"):
        path = make_checkpoint(str(ckpt_dir / arch), arch)
        cfg = load_model_config(path)
        model = load_model(path, cfg, torch.float32, torch.device("cpu"), make_attention_factory("torch"), 64,
                           make_layer_ops("torch"))
        before = model_bytes(model)
        assert pack_cpu_linears(model) > 0
        assert model_bytes(model) == before


def test_lora_engines_pack_the_base_layers(ckpt_dir, tmp_path):
    """Under LoRA the wrapped projections' base layers are packed (an engine with adapters
    computes the base model as one without), and adapter rows still equal PEFT."""
    from tests.helpers.adapters import make_adapter, peft_greedy
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    adapter = make_adapter(path, str(tmp_path / "a"))
    llm = LLM(path, device="cpu", block_size=4, num_kv_blocks=32, lora_modules={"a": adapter})
    layer = llm.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.base, PackedLinear)
    prompts = random_prompts(2, [5, 11], seed=1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0, lora_name="a"))
    assert [o.token_ids for o in outs] == peft_greedy(path, adapter, prompts, 6)
    assert_pool_free(llm)
