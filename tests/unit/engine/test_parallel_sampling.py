"""n > 1 as n one-sequence children (backend.engine.parallel_sampling), and the engine's
refusal of an unfanned n."""

import pytest

from backend import InvalidRequestError, LLM, SamplingParams
from backend.engine.parallel_sampling import child_requests
from tests.conftest import assert_pool_free, random_prompts


def test_one_sequence_is_the_request_itself():
    params = SamplingParams(max_tokens=4)
    assert child_requests("r", params) == [("r", params)]


def test_children_get_distinct_ids_and_offset_seeds():
    children = child_requests("r", SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=5))
    assert [cid for cid, _ in children] == ["r/0", "r/1", "r/2"]
    assert [p.seed for _, p in children] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.8 and p.max_tokens == 5 for _, p in children)
    assert [p.seed for _, p in child_requests("r", SamplingParams(n=2))] == [None, None]


def test_children_reproduce_their_seeded_single_requests(tiny_ckpt):
    """Child i of a seeded request is the single request with seed + i: reproducible alone,
    and the children differ."""
    llm = LLM(tiny_ckpt, block_size=8, num_kv_blocks=64)
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    children = [p for _, p in child_requests("r", params)]
    together = llm.generate(["The yield statement"] * 3, children)
    alone = [llm.generate("The yield statement", SamplingParams(seed=11 + i, temperature=1.0, max_tokens=8,
                                                                 ignore_eos=True))[0] for i in range(3)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together}) > 1
    assert llm.stats()["num_used_blocks"] == 0


def test_engine_refuses_an_unfanned_n(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=8, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="'n'"):
        llm.engine.add_request("x", SamplingParams(n=2))


def _count_prompt_tokens_computed(llm) -> list[int]:
    """Wraps the runner: the list grows by the prompt tokens each step computes."""
    computed: list[int] = []
    launch = llm.engine.runner.launch

    def counting(sched, prev=None):
        computed.append(sum(max(0, min(s.num_new_tokens, s.request.num_prompt_tokens - s.num_computed_tokens))
                            for s in sched.scheduled))
        return launch(sched, prev)
    llm.engine.runner.launch = counting
    return computed


@pytest.mark.parametrize("budget", [512, 4096])   # the parent's prompt chunked, or in one step
def test_n4_children_admitted_together_compute_the_prompt_once(llama_ckpt, budget):
    """n=4 on a 513-token prompt: the first child computes the prompt, the other three
    wait one step (its blocks are pending in the prefix cache) and hit all 32 full blocks:
    hits = 3 x the prompt's full blocks, 513 + 3 prompt tokens computed, not 2,052. Greedy
    children equal transformers' greedy output."""
    from tests.helpers.checkpoints import hf_greedy
    prompt = random_prompts(1, [513], seed=5)[0]
    llm = LLM(llama_ckpt, block_size=16, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=budget,
              device="cpu", dtype="float32")
    computed = _count_prompt_tokens_computed(llm)
    out = llm.generate(prompt, SamplingParams(n=4, max_tokens=6, min_tokens=6, temperature=0))[0]
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == 3 * (513 // 16) * 16
    assert sum(computed) == 513 + 3
    assert [c.num_cached_tokens for c in out.completions] == [0, 512, 512, 512]
    expected = hf_greedy(llama_ckpt, [prompt], 6)[0]
    assert [c.token_ids for c in out.completions] == [expected] * 4
    assert_pool_free(llm)


def test_prefix_caching_off_computes_each_child_prompt(llama_ckpt):
    llm = LLM(llama_ckpt, block_size=16, num_kv_blocks=256, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    computed = _count_prompt_tokens_computed(llm)
    llm.generate(random_prompts(1, [40], seed=5)[0], SamplingParams(n=3, max_tokens=2, temperature=0))
    assert sum(computed) == 3 * 40 and computed[0] == 3 * 40      # all admitted in one step
    assert_pool_free(llm)


def test_offline_generate_with_n(tiny_ckpt):
    """LLM.generate fans n out: per prompt one output (the first completion's, under the
    parent id) whose `completions` are the n children, each the single request with
    seed + i; n == 1 prompts in the same call are plain outputs."""
    llm = LLM(tiny_ckpt, block_size=8, num_kv_blocks=64)
    sampled = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    single = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.generate(["The yield statement", "A generator"], [sampled, single])
    assert len(outs) == 2 and outs[1].completions is None and len(outs[1].token_ids) == 4
    fanned = outs[0]
    assert len(fanned.completions) == 3 and fanned.token_ids == fanned.completions[0].token_ids
    assert [c.request_id.rsplit("/", 1)[1] for c in fanned.completions] == ["0", "1", "2"]
    assert fanned.request_id == fanned.completions[0].request_id.rsplit("/", 1)[0]
    alone = [llm.generate("The yield statement", SamplingParams(seed=11 + i, temperature=1.0, max_tokens=8,
                                                                 ignore_eos=True))[0] for i in range(3)]
    assert [c.token_ids for c in fanned.completions] == [o.token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in fanned.completions}) > 1
    assert_pool_free(llm)
