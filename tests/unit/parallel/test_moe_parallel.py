"""A mixture-of-experts model over tensor_parallel_size=2 (gloo, CPU): experts sliced by
channel like the dense MLP, and with enable_expert_parallel whole experts per rank,
give the single rank's greedy tokens (transformers') with chunked prefill, preemption
and prefix hits; each rank reads only its part of the experts."""

import pytest

from backend import LLM, SamplingParams
from backend.models.config import load_model_config
from backend.parallel.moe_sharding import with_expert_parallel
from backend.parallel.sharding import load_shard
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.moe_checkpoints import make_moe_checkpoint

TIGHT = dict(block_size=4, num_kv_blocks=60, max_num_seqs=16, max_num_batched_tokens=48, dtype="float32")


def _prompts():
    prompts = random_prompts(6, [1, 90, 7, 40, 33, 16], seed=11)
    return prompts + [prompts[1][:60] + [5, 6, 7]]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "expert-parallel"])
def test_moe_two_ranks_give_single_rank_tokens(ckpt_dir, expert_parallel):
    # Qwen2-MoE: routed experts and the channel-sliced shared expert in one all-reduce.
    path = make_moe_checkpoint(str(ckpt_dir / "qwen2_moe"), "qwen2_moe")
    prompts = _prompts()
    expected = hf_greedy(path, prompts, 12)
    with LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **TIGHT) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, min_tokens=12, temperature=0))
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
        assert stats["prefix_cache_hit_tokens"] > 0
        assert_pool_free(llm)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_reads_its_part_of_the_experts(ckpt_dir, expert_parallel):
    path = make_moe_checkpoint(str(ckpt_dir / "qwen2_moe"), "qwen2_moe")
    cfg = with_expert_parallel(load_model_config(path), expert_parallel)
    full = load_shard(path, cfg, 0, 1)
    for rank in (0, 1):
        shard = load_shard(path, cfg, rank, 2)
        experts = sorted({int(n.split(".")[5]) for n in shard if ".mlp.experts." in n and n.startswith("model.layers.0.")})
        gate = shard["model.layers.0.mlp.experts.0.gate_proj.weight"] if 0 in experts else None
        if expert_parallel:
            assert experts == [rank * 3, rank * 3 + 1, rank * 3 + 2]     # 6 experts, 3 whole on each rank
            name = f"model.layers.0.mlp.experts.{rank * 3}.down_proj.weight"
            assert shard[name].equal(full[name])
        else:
            assert experts == list(range(6))
            assert gate.shape == (16, 64)                               # 32 channels, half each
            down = shard["model.layers.0.mlp.experts.5.down_proj.weight"]
            assert down.equal(full["model.layers.0.mlp.experts.5.down_proj.weight"][:, rank * 16:(rank + 1) * 16])
        shared = shard["model.layers.0.mlp.shared_expert.up_proj.weight"]
        assert shared.equal(full["model.layers.0.mlp.shared_expert.up_proj.weight"][rank * 40:(rank + 1) * 40])
        assert shard["model.layers.0.mlp.gate.weight"].equal(full["model.layers.0.mlp.gate.weight"])


def test_mixtral_w1_w3_rows_and_w2_columns_are_sliced(ckpt_dir):
    path = make_moe_checkpoint(str(ckpt_dir / "mixtral"), "mixtral")
    cfg = load_model_config(path)
    full = load_shard(path, cfg, 0, 1)
    key = "model.layers.1.block_sparse_moe.experts.3"
    for rank in (0, 1):
        shard = load_shard(path, cfg, rank, 2)
        rows = slice(rank * 48, (rank + 1) * 48)                        # 96 channels per expert
        assert shard[f"{key}.w1.weight"].equal(full[f"{key}.w1.weight"][rows])
        assert shard[f"{key}.w3.weight"].equal(full[f"{key}.w3.weight"][rows])
        assert shard[f"{key}.w2.weight"].equal(full[f"{key}.w2.weight"][:, rows])
        assert shard["model.layers.1.block_sparse_moe.gate.weight"].shape == (4, 64)
