"""Granite (backend/models/granite.py), the worked example of a new Llama-like
architecture (docs/development.md): greedy output equals transformers' token for token
(fp32, CPU) in a batch mix with chunked prefill, preemption and prefix caching, and its
four multipliers matter (read as Llama, the same weights give other tokens)."""

import json
import os
import shutil

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint

LENGTHS = [1, 70, 7, 33, 120, 16]
MAX_NEW = 16


def generate(path: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(path, block_size=4, num_kv_blocks=70, max_num_seqs=8, max_num_batched_tokens=40)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    assert_pool_free(llm)
    return [o.token_ids for o in outs]


def test_greedy_matches_transformers(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "granite"), "granite")
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=5)
    prompts.append(prompts[1][:50] + [3, 4])            # shares a prefix with the second
    expected = hf_greedy(path, prompts, MAX_NEW)
    assert generate(path, prompts) == expected

    as_llama = str(ckpt_dir / "granite_as_llama")
    if not os.path.isdir(as_llama):
        shutil.copytree(path, as_llama)
        with open(os.path.join(as_llama, "config.json")) as f:
            cfg = json.load(f)
        cfg["architectures"] = ["LlamaForCausalLM"]
        with open(os.path.join(as_llama, "config.json"), "w") as f:
            json.dump(cfg, f)
    assert generate(as_llama, prompts) != expected


def test_two_ranks_give_transformers_tokens(ckpt_dir):
    """No Granite weight differs from Llama's: tensor parallelism splits it as Llama's."""
    path = make_checkpoint(str(ckpt_dir / "granite"), "granite")
    prompts = random_prompts(3, [1, 30, 9], seed=6)
    with LLM(path, tensor_parallel_size=2, block_size=8, num_kv_blocks=32, dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
        assert [o.token_ids for o in outs] == hf_greedy(path, prompts, 8)
        assert_pool_free(llm)
