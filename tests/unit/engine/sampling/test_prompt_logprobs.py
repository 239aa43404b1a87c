"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): each prompt token's log
probability given the tokens before it, its rank and the k most likely tokens, computed in
the batched step chunk by chunk, against transformers' log-softmax of the fp32 logits
(1e-4), in batches that mix requests with and without them, with chunked prefill,
preemption, async scheduling on and off, and the prefix cache."""

import pytest

from backend import LLM, SamplingParams
from backend.engine.errors import InvalidRequestError
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.prompt_logprobs import check_against_transformers


@pytest.fixture(scope="module")
def path(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_match_transformers_in_a_mixed_batch(path, async_scheduling):
    prompts = random_prompts(5, [30, 5, 23, 9, 1], seed=11)
    params = [SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.8, seed=2, prompt_logprobs=0, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)]
    # A small pool and budget: prompts are chunked and requests preempted.
    llm = LLM(path, block_size=4, num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats["num_chunked_prefills"] > 0 and stats["num_preemptions"] > 0
    assert_pool_free(llm)
    plain = LLM(path, block_size=4, num_kv_blocks=64, async_scheduling=async_scheduling)
    for out, prompt, p in zip(outs, prompts, params):
        # Asking for prompt logprobs changes no token.
        assert out.token_ids == plain.generate(prompt, p.model_copy(update={"prompt_logprobs": None}))[0].token_ids
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        check_against_transformers(path, prompt, out.prompt_logprobs, p.prompt_logprobs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_request_preempted_mid_prompt_reports_each_position_once(path, async_scheduling):
    """Two decoding requests grow into a small pool: the long prompt-logprobs request,
    admitted last, is preempted halfway through its prompt, recomputes (cache hits only
    below the positions it still needs) and reports every position once, exactly."""
    prompts = random_prompts(3, [6, 6, 40], seed=5)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2 + [
        SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)]
    llm = LLM(path, block_size=4, num_kv_blocks=13, max_num_seqs=4, max_num_batched_tokens=8,
              async_scheduling=async_scheduling)
    scheduler, preempted = llm.engine.scheduler, []
    preempt = scheduler._preempt

    def record(request):
        preempted.append((request.request_id, request.num_prompt_logprob_rows, request.prompt_logprob_rows_end))
        preempt(request)
    scheduler._preempt = record
    outs = llm.generate(prompts, params)
    assert any(0 < done < end for _, done, end in preempted), preempted      # mid-prompt
    check_against_transformers(path, prompts[2], outs[2].prompt_logprobs, 2)
    assert_pool_free(llm)


def test_prompt_logprobs_bypass_the_prefix_cache_and_come_once(tiny_ckpt):
    """A prompt already cached is computed again for a request with prompt logprobs (every
    position needs its logits); one without takes the hits; the streamed outputs carry the
    list once, on the first token, with each token's text."""
    llm = LLM(tiny_ckpt, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    prompt = llm.tokenizer.encode("The pass statement does nothing at all; it is used where a statement is "
                                  "required by the syntax but no code needs to run, for instance here.")
    assert len(prompt) > 24          # chunked, two full blocks or more
    first = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))[0]
    assert first.prompt_logprobs is None
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2), "with")
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.new_token_ids or out.finished          # no output for a prompt chunk alone
            seen.append(out)
    assert seen[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in seen[1:-1])
    final = seen[-1]
    assert final.num_cached_tokens == 0 and final.prompt_logprobs == seen[0].prompt_logprobs
    assert final.token_ids == llm.generate(prompt, SamplingParams(max_tokens=3, temperature=0))[0].token_ids
    check_against_transformers(tiny_ckpt, prompt, final.prompt_logprobs, 2)
    # The prompt tokens' texts spell the prompt after its first token.
    text = "".join(e[t].decoded_token for e, t in zip(final.prompt_logprobs[1:], prompt[1:]))
    assert llm.tokenizer.decode(prompt[:1]) + text == llm.tokenizer.decode(prompt)
    assert all(isinstance(lp.decoded_token, str) for e in final.prompt_logprobs[1:] for lp in e.values())
    hit = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))[0]
    assert hit.num_cached_tokens > 0
    assert_pool_free(llm)


def test_n_children_share_one_prompt_logprobs_and_the_limit(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64, max_logprobs=4)
    out = llm.generate("The pass statement", SamplingParams(n=3, max_tokens=2, seed=1, prompt_logprobs=1))[0]
    assert out.prompt_logprobs is not None and out.completions[0].prompt_logprobs == out.prompt_logprobs
    assert [c.prompt_logprobs for c in out.completions[1:]] == [None, None]
    with pytest.raises(InvalidRequestError, match="'prompt_logprobs' is 5, more than max_logprobs=4"):
        llm.generate("x", SamplingParams(prompt_logprobs=5))
    assert_pool_free(llm)


def test_prefix_hits_and_prompt_logprobs_in_one_chunked_batch(path):
    """One batch, chunked: a request without prompt logprobs takes prefix-cache hits on a
    cached prefix while two with prompt logprobs (one on the same prefix) compute their
    whole prompts next to it; the cached prompt tokens still get their logprobs, equal to
    transformers' (1e-4), and every request decodes as it would alone."""
    prefix = random_prompts(1, [24], seed=21)[0]
    tails = random_prompts(3, [7, 9, 5], seed=22)
    prompts = [prefix + tails[0], prefix + tails[1], tails[2] + prefix[:10]]
    params = [SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0, ignore_eos=True)]
    llm = LLM(path, block_size=4, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=12)
    llm.generate(prefix, SamplingParams(max_tokens=1, temperature=0))          # caches the prefix
    before = llm.stats()["num_chunked_prefills"]
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_chunked_prefills"] > before
    assert outs[0].num_cached_tokens >= 20 and outs[1].num_cached_tokens == 0
    assert outs[0].prompt_logprobs is None
    for out, prompt, p in zip(outs[1:], prompts[1:], params[1:]):
        check_against_transformers(path, prompt, out.prompt_logprobs, p.prompt_logprobs)
    plain = LLM(path, block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(
        prompts, [p.model_copy(update={"prompt_logprobs": None}) for p in params])]
    assert_pool_free(llm)
