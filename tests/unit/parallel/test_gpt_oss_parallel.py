"""gpt-oss over tensor_parallel_size=2 (gloo, CPU): sinks split by head, the stacked
interleaved experts by channel, the down bias added once, greedy = transformers with
chunked prefill, preemption and prefix hits. The MXFP4 tensors' slices (checked without
processes): by 32-channel scale groups, or whole experts with enable_expert_parallel.
(Checked by hand on 2026-11-25, not in CI for time: expert parallelism on the float
checkpoint, and both splits on an MXFP4 one with 64 channels per expert, all giving
transformers' tokens.)"""

import torch

from backend import LLM, SamplingParams
from backend.models.config import load_model_config
from backend.parallel.moe_sharding import with_expert_parallel
from backend.parallel.sharding import check_tensor_parallel, load_shard
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy
from tests.helpers.moe_checkpoints import make_moe_checkpoint
from tests.unit.models.test_gpt_oss import make_mxfp4_pair


def test_two_ranks_give_transformers_tokens(ckpt_dir):
    path = make_moe_checkpoint(str(ckpt_dir / "gpt_oss"), "gpt_oss")
    prompts = random_prompts(3, [1, 50, 9], seed=11)
    prompts.append(prompts[1][:40] + [5, 6, 7])
    expected = hf_greedy(path, prompts, 8)
    with LLM(path, tensor_parallel_size=2, block_size=4, num_kv_blocks=20, max_num_seqs=16,
             max_num_batched_tokens=32, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
        assert [o.token_ids for o in outs] == expected
        stats = llm.stats()
        assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
        assert stats["prefix_cache_hit_tokens"] > 0
        assert_pool_free(llm)


def test_mxfp4_slices(ckpt_dir):
    _, packed = make_mxfp4_pair(str(ckpt_dir))
    cfg = load_model_config(packed)
    # 32 channels per expert: a 16-channel half would cut a scale group.
    assert "multiple of 32" in check_tensor_parallel(cfg, 2)
    ep = with_expert_parallel(cfg, True)
    assert check_tensor_parallel(ep, 2) is None
    full = load_shard(packed, cfg, 0, 1)
    ranks = [load_shard(packed, ep, r, 2) for r in range(2)]
    for name in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales",
                 "gate_up_proj_bias", "down_proj_bias"):
        key = f"model.layers.1.mlp.experts.{name}"
        assert torch.equal(torch.cat([r[key] for r in ranks]), full[key]), name
    sinks = "model.layers.0.self_attn.sinks"
    assert torch.equal(torch.cat([r[sinks] for r in ranks]), full[sinks])
