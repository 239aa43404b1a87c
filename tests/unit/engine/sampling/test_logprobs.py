"""Per-token logprobs (SamplingParams.logprobs) against transformers' own log-softmax of
the same sequence (fp32, CPU: the 1e-4 tolerance holds in fp32), in a batch that mixes
requests with and without logprobs, greedy and sampled, with chunked prefill and
preemption."""

import math

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.sampling import logprobs
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_logprobs, make_checkpoint


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprobs_match_transformers_in_a_mixed_batch(ckpt_dir, backend):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = random_prompts(4, [30, 5, 17, 9], seed=6)
    params = [SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=5, logprobs=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=3, logprobs=5, ignore_eos=True)]
    llm = LLM(path, block_size=4, num_kv_blocks=14, max_num_seqs=4, max_num_batched_tokens=16,
              attention_backend=backend)
    outs = llm.generate(prompts, params)
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["num_chunked_prefills"] > 0
    assert_pool_free(llm)
    assert outs[1].logprobs is None and outs[1].cumulative_logprob is None
    for out, prompt, p in zip(outs, prompts, params):
        if p.logprobs is None:
            continue
        ref = hf_logprobs(path, prompt, out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        total = 0.0
        for pos, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[pos]
            assert next(iter(entry)) == token  # the generated token first
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(p.logprobs).indices.tolist()
            assert set(top) <= set(entry)
            for t in top:
                assert entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
            assert len(entry) <= p.logprobs + 1
            total += entry[token].logprob
        if p.temperature == 0:
            assert all(e[t].rank == 1 for t, e in zip(out.token_ids, out.logprobs))
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-6)
        assert math.isfinite(out.cumulative_logprob) and out.cumulative_logprob < 0


def test_logprobs_stream_one_entry_per_token_with_text(tiny_ckpt):
    """Each step's output carries the new token's entry, with each token's text."""
    llm = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64)
    engine = llm.engine
    engine.add_request("The pass statement", SamplingParams(max_tokens=5, temperature=0, logprobs=2,
                                                            ignore_eos=True), "r")
    seen, running = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(out.new_logprobs) == len(out.new_token_ids)
            seen += out.new_logprobs
            running = out.cumulative_logprob
            final = out
    assert final.finished and final.logprobs == seen and len(seen) == 5
    assert running == pytest.approx(sum(e[t].logprob for e, t in zip(seen, final.token_ids)))
    # Each token's text is what it adds to the output (vLLM's decoded_token): the
    # generated tokens' texts spell the output; the alternatives' are strings too.
    assert "".join(e[t].decoded_token for e, t in zip(seen, final.token_ids)) == final.text
    assert all(isinstance(lp.decoded_token, str) for e in seen for lp in e.values())


def test_pack_and_unpack_roundtrip():
    logits = torch.randn(3, 50)
    sampled = torch.tensor([4, 7, 9])
    want = logprobs.LogprobRows(rows=torch.tensor([0, 2]), counts=[2, 0], row_ids=[0, 2], max_count=2)
    tokens, by_row = logprobs.unpack(logprobs.pack(logits, sampled, want).tolist(), 3, want)
    assert tokens == [4, 7, 9] and set(by_row) == {0, 2}
    ref = torch.log_softmax(logits, dim=-1)
    assert list(by_row[2]) == [9]  # counts 0: the sampled token alone
    top = ref[0].topk(2).indices.tolist()
    assert list(by_row[0])[0] == 4 and set(top) <= set(by_row[0])
    assert by_row[0][4].logprob == pytest.approx(ref[0, 4].item(), abs=1e-6)
    assert logprobs.unpack(logprobs.pack(logits, sampled, None).tolist(), 3, None) == ([4, 7, 9], {})
