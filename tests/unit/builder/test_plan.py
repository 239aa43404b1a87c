"""The planner's memory rows against what the engine allocates, its arithmetic against a
worked example, and the CLI."""

import json

import pytest

from backend import LLM
from backend.models.config import load_model_config, model_config_from_dict
from builder import plan
from builder.__main__ import main
from tests.helpers.checkpoints import make_checkpoint


def engine_weight_bytes(llm) -> int:
    """The engine's own figure: its parameters (tied embeddings once) and what its CPU
    linears' weights occupied before oneDNN packed them."""
    return llm.engine.bytes_per_rank[0][0]


@pytest.mark.parametrize("arch,kv_dtype,block_size", [("llama", "auto", 16), ("qwen2", "auto", 8),
                                                      ("qwen3", "fp8", 4)])
def test_memory_rows_equal_the_engines_own_figures(ckpt_dir, arch, kv_dtype, block_size):
    path = make_checkpoint(str(ckpt_dir / arch), arch)
    cfg = load_model_config(path)
    budget = 3_000_000
    llm = LLM(path, dtype="float32", block_size=block_size, kv_cache_memory_bytes=budget, kv_cache_dtype=kv_dtype)
    e = llm.engine
    plan_kv = "fp8" if kv_dtype == "fp8" else "float32"
    assert plan.kv_bytes_per_token(cfg, plan_kv) == e.kv_cache_bytes // (e.num_kv_blocks * block_size)
    assert plan.kv_blocks(budget, cfg, plan_kv, block_size) == e.num_kv_blocks
    assert plan.weight_bytes(cfg, "float32") == engine_weight_bytes(llm)
    # Sequences of 200 tokens that fit: what the KV cache manager can hand out at once.
    n = plan.max_sequences(e.num_kv_blocks, 200, block_size)
    assert n == e.num_kv_blocks // -(-200 // block_size) and n > 0


@pytest.mark.parametrize("arch, overrides", [("qwen2", {"vocab_size": 321}), ("llama", {"num_key_value_heads": 1})],
                         ids=["qwen2-bias-padded-vocab", "llama-replicated-kv-head"])
def test_tensor_parallel_rows_equal_each_ranks_figures(ckpt_dir, arch, overrides):
    path = make_checkpoint(str(ckpt_dir / f"plan_tp_{arch}"), arch, **overrides)
    cfg = load_model_config(path)
    budget, block_size = 2_000_000, 8
    with LLM(path, device="cpu", dtype="float32", block_size=block_size, kv_cache_memory_bytes=budget,
             tensor_parallel_size=2) as llm:
        ranks = llm.stats()["bytes_per_rank"]
    blocks = plan.kv_blocks(budget, cfg, "float32", block_size, tp=2)
    assert ranks == [(plan.weight_bytes(cfg, "float32", tp=2),
                      blocks * block_size * plan.kv_bytes_per_token(cfg, "float32", tp=2))] * 2


def test_public_config_counts_and_tensor_parallel_shards():
    cfg = model_config_from_dict(plan.NAMED_CONFIGS["llama-3.1-8b"])
    assert plan.count_params(cfg).total == 8_030_261_248  # Llama 3.1 8B's published count
    assert plan.weight_bytes(cfg, "bf16") == 2 * 8_030_261_248
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size        # whole on every rank
    assert plan.weight_bytes(cfg, "bf16", tp=2) == 2 * ((8_030_261_248 - norms) // 2 + norms)
    assert plan.weight_bytes(cfg, "int4") < plan.weight_bytes(cfg, "fp8") < plan.weight_bytes(cfg, "bf16")
    assert plan.kv_bytes_per_token(cfg, "bf16") == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert plan.kv_bytes_per_token(cfg, "bf16", 2) == 2 * 32 * 4 * 128 * 2
    assert plan.kv_bytes_per_token(cfg, "bf16", 16) == 2 * 32 * 1 * 128 * 2      # KV heads replicated


def test_worked_cost_example():
    """An A100 at $3.50/h is $2,520 a month; against $40 per million API tokens the
    break-even is 63M tokens a month."""
    c = plan.cost_plan(3.50, api_price_per_million=40.0)
    assert c.replicas == 1 and c.monthly_cost == pytest.approx(2520.0)
    assert c.break_even_tokens_per_month == pytest.approx(63e6)
    # 1M requests/day of 500 output tokens need 5,787 tok/s: 3 replicas at 2,000 tok/s.
    c = plan.cost_plan(3.50, 2, 1e6, 1000, 500, output_tokens_per_s=2000.0)
    assert c.replicas == 3 and c.monthly_cost == pytest.approx(3 * 2 * 3.50 * 720)
    assert c.cost_per_million_tokens == pytest.approx(c.monthly_cost / (1e6 * 30 * 1500 / 1e6))


def test_cli_table_and_json(tmp_path, capsys, llama_ckpt):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "A100-80GB", "--api-price-per-million", "40",
                 "--tp", "1", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "$2,520/month" in text and "63.0M tokens/month" in text
    data = json.loads(out.read_text())
    assert {r["tp"] for r in data["memory"]} == {1, 2} and data["cost"]["monthly_cost"] == pytest.approx(2520)
    assert main(["plan", "--checkpoint", llama_ckpt, "--gpu-memory-gb", "1", "--gpu-price-per-hour", "1",
                 "--weights", "float32", "--kv-cache", "float32", "--tp", "1"]) == 0
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "TPU"]) != 0


def test_pipeline_rows_per_stage_and_bubble(tmp_path, capsys):
    """--pp: each stage's layers (80 over 2 stages of 8 GPUs for Llama 3.1 70B), the
    embedding on stage 0 and the head on the last, the fullest stage in the row, and the
    bubble: half of each GPU's time idle with one batch in flight over two stages."""
    cfg = model_config_from_dict(plan.NAMED_CONFIGS["llama-3.1-70b"])
    first, last = plan.stages(cfg, 8, 2)
    assert (first.start_layer, first.end_layer, last.start_layer, last.end_layer) == (0, 40, 40, 80)
    whole = plan.weight_bytes(cfg, "bf16", 8)
    # Untied: the stages partition the weights (tied ones: the last stage's head is a copy).
    assert plan.weight_bytes(cfg, "bf16", 8, first) + plan.weight_bytes(cfg, "bf16", 8, last) == whole
    assert plan.kv_bytes_per_token(cfg, "bf16", 8, first) * 2 == plan.kv_bytes_per_token(cfg, "bf16", 8)
    assert [plan.pipeline_bubble(p, m) for p, m in [(1, 1), (2, 1), (4, 1), (4, 2), (4, 4), (2, 8)]] == [
        0.0, 0.5, 0.75, 0.5, 0.0, 0.0]
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3.1-70b", "--gpu", "H100-80GB", "--tp", "8", "--pp", "1", "2",
                 "--weights", "bf16", "--micro-batches", "1", "--workload-tp", "8", "--workload-pp", "2",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bubble" in text and "16 GPU(s)" in text
    rows = {r["pp"]: r for r in json.loads(out.read_text())["memory"]}
    assert rows[2]["pipeline_bubble"] == 0.5 and [s["layers"] for s in rows[2]["stages"]] == [[0, 40], [40, 80]]
    assert rows[2]["weight_bytes_per_rank"] == max(s["weight_bytes_per_rank"] for s in rows[2]["stages"])
    assert rows[2]["weight_bytes_per_rank"] < 0.6 * rows[1]["weight_bytes_per_rank"]
    assert rows[2]["kv_blocks"] > rows[1]["kv_blocks"]
    big = model_config_from_dict(plan.NAMED_CONFIGS["llama-3.1-405b"])
    assert plan.count_params(big).total == 405_853_388_800       # Llama 3.1 405B's published count


def test_host_kv_tier_tokens_equal_the_engines_host_slots(ckpt_dir, capsys):
    """`--kv-offloading-size`: each row says how many tokens the host tier holds, the
    engine's own count of host slots times the block size."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    cfg = load_model_config(path)
    size = 0.001
    row = plan.memory_rows(cfg, 1, 0.9, ["float32"], "float32", [1], [64], 16, 8, kv_offloading_gb=size)[0]
    llm = LLM(path, block_size=16, num_kv_blocks=8, kv_offloading_size=size)
    assert row.host_kv_tokens // 16 == llm.engine.stats()["kv_offload_host_blocks"]
    assert main(["plan", "--model", "llama-3.1-8b", "--tp", "1", "--weights", "bf16", "--kv-offloading-size",
                 "64"]) == 0
    out = capsys.readouterr().out
    assert "host KV tokens" in out and "524,288" in out       # 64 GiB / 128 KiB a token


@pytest.mark.parametrize("method", ["draft_model", "eagle3", "medusa"])
def test_a_drafters_kv_and_weights_are_the_engines(ckpt_dir, llama_ckpt, method):
    """The K/V a drafter adds per token (plan_draft.py) is what the engine's blocks hold
    more, and its parameters are its checkpoint's."""
    from builder.eagle_heads import random_head
    from builder.medusa_heads import random_heads
    from builder.plan_draft import drafter
    from backend.config import SpeculativeConfig
    target = make_checkpoint(str(ckpt_dir / "llama_eagle_target"), "llama", initializer_range=0.05,
                             num_hidden_layers=4)
    model = {"draft_model": llama_ckpt,
             "eagle3": random_head(target, str(ckpt_dir / "plan_eagle3_head"), draft_vocab=100),
             "medusa": random_heads(target, str(ckpt_dir / "plan_medusa_heads"), num_heads=2)}[method]
    spec = {"method": method, "model": model, "num_speculative_tokens": 2}
    d = drafter(SpeculativeConfig.model_validate(spec))
    e = LLM(target, dtype="float32", block_size=16, kv_cache_memory_bytes=3_000_000, speculative_config=spec).engine
    cfg = load_model_config(target)
    assert plan.kv_bytes_per_token(cfg, "float32") + d.kv_elems_per_token * 4 == \
        e.kv_cache_bytes // (e.num_kv_blocks * 16)
    assert (d.kv_elems_per_token > 0) == (method != "medusa")
    drafter_module = e.speculator.proposer.model if method != "medusa" else e.speculator.proposer.heads
    own = sum(p.numel() for n, p in drafter_module.named_parameters() if "embed_tokens" not in n or
              method == "draft_model")
    assert d.params >= own and d.params - own <= 2 * cfg.vocab_size     # (+ d2t / t2d maps)
