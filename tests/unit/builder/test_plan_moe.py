"""The planner counts a mixture-of-experts model's total and active parameters: its
weight bytes equal what the engine loads (one rank and, with expert parallelism, each of
two ranks), the public configs give their published counts, and `builder plan` prints
both."""

import pytest

from backend import LLM
from backend.models.config import load_model_config, model_config_from_dict
from backend.parallel.moe_sharding import with_expert_parallel
from builder import plan
from builder.__main__ import main
from tests.helpers.moe_checkpoints import MOE_ARCHS, make_moe_checkpoint
from tests.unit.builder.test_plan import engine_weight_bytes


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_weight_bytes_equal_the_engines(ckpt_dir, arch):
    path = make_moe_checkpoint(str(ckpt_dir / arch), arch)
    cfg = load_model_config(path)
    llm = LLM(path, dtype="float32", block_size=8, kv_cache_memory_bytes=1_000_000)
    assert plan.weight_bytes(cfg, "float32") == engine_weight_bytes(llm)
    counts = plan.count_params(cfg)
    moe = cfg.moe
    unused_experts = (moe.num_experts - moe.top_k) * sum(moe.sparse_layers)
    per_expert = 3 * cfg.hidden_size * moe.intermediate_size
    if moe.expert_bias:      # gpt-oss: an idle expert's biases are idle too
        per_expert += 2 * moe.intermediate_size + cfg.hidden_size
    assert counts.total - counts.active == unused_experts * per_expert


def test_expert_parallel_rank_bytes(ckpt_dir):
    path = make_moe_checkpoint(str(ckpt_dir / "qwen2_moe"), "qwen2_moe")
    cfg = with_expert_parallel(load_model_config(path), True)
    budget, block_size = 1_000_000, 8
    with LLM(path, device="cpu", dtype="float32", block_size=block_size, kv_cache_memory_bytes=budget,
             tensor_parallel_size=2, enable_expert_parallel=True) as llm:
        ranks = llm.stats()["bytes_per_rank"]
    assert [w for w, _ in ranks] == [plan.weight_bytes(cfg, "float32", tp=2)] * 2


def test_published_moe_counts_and_cli(capsys):
    mixtral = plan.count_params(model_config_from_dict(plan.NAMED_CONFIGS["mixtral-8x7b"]))
    assert mixtral.total == 46_702_792_704            # Mixtral 8x7B's published count
    assert round(mixtral.active / 1e9, 1) == 12.9      # "12.9B active parameters"
    qwen = plan.count_params(model_config_from_dict(plan.NAMED_CONFIGS["qwen3-30b-a3b"]))
    assert round(qwen.total / 1e9, 1) == 30.5 and 3.3e9 < qwen.active < 3.4e9   # "30.5B, 3.3B activated"
    # gpt-oss's model card: 20.91B / 116.83B total, 3.61B / 5.13B active, which excludes
    # the 0.58B embedding table (a lookup); our active count includes it.
    embedding = 201088 * 2880
    for name, total, active in [("gpt-oss-20b", 20.91, 3.61), ("gpt-oss-120b", 116.83, 5.13)]:
        counts = plan.count_params(model_config_from_dict(plan.NAMED_CONFIGS[name]))
        assert round(counts.total / 1e9, 2) == total and round((counts.active - embedding) / 1e9, 2) == active
    # Published MXFP4, kept packed: gpt-oss-120b fits one 80 GB GPU (as its card says), bf16 does not.
    big = model_config_from_dict(plan.NAMED_CONFIGS["gpt-oss-120b"])
    rows = {r.weights: r for r in plan.memory_rows(big, 80, 0.9, ["bf16", "mxfp4"], "bf16", [1], [8192], 16, 64)}
    assert rows["mxfp4"].fits and not rows["bf16"].fits
    assert 60 < rows["mxfp4"].weight_bytes_per_rank / 2**30 < 62
    assert main(["plan", "--model", "mixtral-8x7b", "--gpu", "H100-80GB"]) == 0
    assert "parameters: 46,702,792,704 total, 12,879,925,248 active per token" in capsys.readouterr().out
