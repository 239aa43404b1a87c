"""The engine thread's intra-op threads per step (backend/engine/runner/cpu_threads.py):
one for a small step, `busy` for the rest, where the policy applies; the user's count
back after `generate`."""

from types import SimpleNamespace

import torch

from backend import LLM, SamplingParams
from backend.engine.runner import cpu_threads
from backend.engine.runner.cpu_threads import StepThreads, restore_caller_threads, sequence_costs, step_threads
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.threads import on_fresh_thread


def _meta(query_lens, seq_lens):
    return SimpleNamespace(query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


def test_a_small_step_runs_with_one_thread_and_a_larger_one_with_busy():
    policy = StepThreads(busy=2, hidden_size=256, min_cost=100.0)
    assert sum(sequence_costs([1], [64], 256)) == 9.0       # a decode row: 1 + 64 keys x 32 / 256

    def run():
        torch.set_num_threads(2)
        counts = []
        for meta in (_meta([1], [64]), _meta([1] * 16, [64] * 16), _meta([1] * 8, [64] * 8), _meta([40], [40])):
            policy.apply(meta)
            counts.append(torch.get_num_threads())
        restore_caller_threads()
        return counts, torch.get_num_threads()
    # 9, 144, 72 and 40 x 6 = 240 tokens' worth against 100
    assert on_fresh_thread(run) == ([1, 2, 1, 2], 2)


def test_the_policy_applies_only_where_it_changes_something():
    def build(**kw):
        args = dict(eligible=True, busy=2, hidden_size=256, num_layers=4, fits_cache=True, min_work=64e6)
        args.update(kw)
        return step_threads(**args)

    def run():
        torch.set_num_threads(2)
        made = [build(), build(eligible=False), build(fits_cache=False)]
        torch.set_num_threads(1)
        made.append(build())                    # one thread: nothing to lower
        torch.set_num_threads(2)
        return made
    policy, not_eligible, beyond_cache, one_thread = on_fresh_thread(run)
    assert policy.min_cost == 64e6 / (256 ** 2 * 4) and policy.busy == 2
    assert not_eligible is None and beyond_cache is None and one_thread is None


def test_the_engine_runs_small_steps_on_one_thread_with_the_same_tokens(ckpt_dir, monkeypatch):
    """Unsplit (cpu_forward_shards=1): decode steps of a few rows run with one thread, a
    step past the threshold with both, and the tokens are transformers' greedy ones."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = random_prompts(3, [5, 9, 30], seed=1)
    # The threshold lowered to 100 tokens' worth (hidden 64, 2 layers), so that the
    # prompts' step (44 tokens) is past it and decode steps (3 rows) are not.
    monkeypatch.setattr(cpu_threads, "MIN_SHARED_STEP_WORK", 100 * 64 ** 2 * 2)

    def run():
        torch.set_num_threads(2)
        llm = LLM(path, device="cpu", block_size=8, num_kv_blocks=64, cpu_forward_shards=1,
                  max_num_batched_tokens=64)
        seen = []
        real_sample = llm.engine.runner.sample
        llm.engine.runner.sample = lambda launched, grammar_bitmask=None: (
            seen.append((launched.sched.num_tokens, torch.get_num_threads())),
            real_sample(launched, grammar_bitmask))[1]
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, min_tokens=6, temperature=0))
        assert_pool_free(llm)
        llm.engine.shutdown()
        return [o.token_ids for o in outs], seen, torch.get_num_threads()
    tokens, seen, after = on_fresh_thread(run)
    assert tokens == hf_greedy(path, prompts, 6)
    assert after == 2
    assert {n for tokens_in_step, n in seen if tokens_in_step <= 3} == {1}
    assert {n for tokens_in_step, n in seen if tokens_in_step >= 30} == {2}
    assert any(t <= 3 for t, _ in seen) and any(t >= 30 for t, _ in seen)
