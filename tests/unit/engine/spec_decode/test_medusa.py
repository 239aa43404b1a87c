"""Medusa speculative decoding (fp32, CPU): random heads in the Medusa authors' layout on
a random Llama. Their proposals equal the heads applied to transformers' final hidden
state, greedy output equals speculation off with chunked prefill, preemption, prefix
hits and async scheduling, and the pool ends free."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from backend.config import ConfigError
from builder.medusa_heads import random_heads
from tests.conftest import assert_pool_free
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.spec_batch import MAX_NEW, assert_greedy_unchanged

ENGINE = dict(block_size=4, num_kv_blocks=100, max_num_seqs=16, max_num_batched_tokens=48, dtype="float32")


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama_repetitive"), "llama", initializer_range=0.05)


@pytest.fixture(scope="module", params=[False, True], ids=["own_lm_heads", "original_lm_head"])
def heads(target, ckpt_dir, request):
    return random_heads(target, str(ckpt_dir / f"medusa_{request.param}"), num_heads=3, num_layers=1, seed=5,
                        original_lm_head=request.param)


def medusa(heads: str, k: int) -> dict:
    return {"method": "medusa", "model": heads, "num_speculative_tokens": k}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_output_is_unchanged(target, heads, prompts, reference, async_scheduling):
    llm = LLM(target, speculative_config=medusa(heads, 3), async_scheduling=async_scheduling, **ENGINE)
    assert_greedy_unchanged(llm, prompts, reference, MAX_NEW)


def test_proposals_are_the_heads_on_the_final_hidden_state(target, heads, prompts):
    from transformers import AutoModelForCausalLM
    llm = LLM(target, speculative_config=medusa(heads, 3), **ENGINE)
    scheduler, seen = llm.engine.scheduler, []
    set_proposals = scheduler.set_proposals

    def record(proposals):
        for request_id, (tokens, _) in proposals.tokens.items():
            seen.append((list(scheduler.requests[request_id].all_token_ids), tokens.tolist()))
        set_proposals(proposals)
    scheduler.set_proposals = record
    llm.generate(prompts[:10], SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    assert llm.stats()["num_preemptions"] > 0
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    w = load_file(f"{heads}/medusa_lm_head.safetensors")
    checked = 0
    with torch.no_grad():
        for tokens, proposed in seen[::4]:
            # The target computed all but the newest token: its last hidden state is there.
            h = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
            for i, got in enumerate(proposed):
                x = h + F.silu(w[f"{i}.0.linear.weight"] @ h + w[f"{i}.0.linear.bias"])
                logits = (w[f"{i}.1.weight"] if f"{i}.1.weight" in w else hf.lm_head.weight) @ x
                top = logits.topk(2)
                if float(top.values[0] - top.values[1]) < 1e-3:
                    continue            # a near-tie: rounding's to break
                assert got == int(top.indices[0]), f"head {i} after {len(tokens)} tokens"
                checked += 1
    assert checked > 100
    assert_pool_free(llm)


def test_more_proposals_than_heads_is_refused(target, heads):
    with pytest.raises(ConfigError, match="num_speculative_tokens.*3"):
        LLM(target, speculative_config=medusa(heads, 4), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="speculative_config.model.*not a Medusa checkpoint"):
        LLM(target, speculative_config=medusa(target, 2), num_kv_blocks=64)
    from backend.config import EngineArgs
    with pytest.raises(ValueError, match="'medusa' runs on one rank"):      # (rank 0 holds a vocabulary slice)
        EngineArgs.create(model=target, tensor_parallel_size=2, speculative_config=medusa(heads, 2))
