"""Each rank reads exactly its slices of the checkpoint (no process group needed)."""

from dataclasses import replace

import pytest
import torch

from backend.config import ConfigError, EngineArgs
from backend.engine.llm_engine import LLMEngine
from backend.models.config import ModelConfig, load_model_config
from backend.models.loader import load_weights
from backend.parallel.sharding import check_tensor_parallel, kv_head_range, load_shard, local_config
from tests.helpers.checkpoints import make_checkpoint


def _join(shards, name, dim, rows=None):
    full = torch.cat([s[name] for s in shards], dim=dim)
    return full if rows is None else full[:rows]


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_shards_reassemble_the_checkpoint(ckpt_dir, kv_heads):
    path = make_checkpoint(str(ckpt_dir / f"shard_kv{kv_heads}"), "qwen2", num_key_value_heads=kv_heads,
                           vocab_size=321)   # odd: the last vocab shard is padded
    cfg = load_model_config(path)
    full = load_weights(path)
    shards = [load_shard(path, cfg, r, 2) for r in range(2)]
    layer = "model.layers.1."
    for name in ("q_proj.weight", "q_proj.bias"):
        assert torch.equal(_join(shards, layer + "self_attn." + name, 0), full[layer + "self_attn." + name])
    for name in ("gate_proj.weight", "up_proj.weight"):
        assert torch.equal(_join(shards, layer + "mlp." + name, 0), full[layer + "mlp." + name])
    assert torch.equal(_join(shards, layer + "self_attn.o_proj.weight", 1), full[layer + "self_attn.o_proj.weight"])
    assert torch.equal(_join(shards, layer + "mlp.down_proj.weight", 1), full[layer + "mlp.down_proj.weight"])
    emb = "model.embed_tokens.weight"
    assert shards[0][emb].shape[0] == shards[1][emb].shape[0] == 161
    assert torch.equal(_join(shards, emb, 0, rows=321), full[emb])
    assert torch.all(shards[1][emb][-1] == 0)
    for name in ("k_proj.weight", "v_proj.bias"):
        key = layer + "self_attn." + name
        if kv_heads == 2:
            assert torch.equal(_join(shards, key, 0), full[key])
        else:   # one KV head, replicated on both ranks
            assert torch.equal(shards[0][key], full[key]) and torch.equal(shards[1][key], full[key])
    assert torch.equal(shards[1][layer + "input_layernorm.weight"], full[layer + "input_layernorm.weight"])


def test_kv_heads_follow_the_query_heads_they_serve():
    base = ModelConfig("LlamaForCausalLM", 320, 64, 160, 2, 8, 2, 8, 1e-6, 64, 1e4, None, False, False, False,
                       False, "silu", "float32", (None, None))
    # 8 query heads, 2 KV heads (groups of 4), 4 ranks: ranks 0-1 need KV head 0, 2-3 head 1.
    assert [kv_head_range(base, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(replace(base, num_kv_heads=8), r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert local_config(base, 4).num_kv_heads == 1 and local_config(base, 4).num_heads == 2


@pytest.mark.parametrize("tp, reason", [(3, "attention heads"), (8, "attention heads")])
def test_impossible_splits_are_refused_naming_the_field(llama_ckpt, tp, reason):
    assert reason in check_tensor_parallel(load_model_config(llama_ckpt), tp)
    with pytest.raises(ConfigError, match=f"'tensor_parallel_size': {tp} .*{reason}"):
        LLMEngine(EngineArgs.create(model=llama_ckpt, tensor_parallel_size=tp, num_kv_blocks=8))


def test_exported_graph_runners_refuse_tensor_parallelism(llama_ckpt):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineArgs.create(model=llama_ckpt, tensor_parallel_size=2, model_runner="onnxruntime", model_graph="x.onnx")
