"""typical_p, the worked example of a logits processor (docs/development.md): the same
kept tokens and distribution as transformers' TypicalLogitsWarper, the same sampled
tokens as transformers' generate, and the parameter validated where requests arrive."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TypicalLogitsWarper

from backend import LLM
from backend.engine.errors import InvalidRequestError
from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.sampler import Sampler
from backend.sampling_params import SamplingParams, SamplingParamsError
from backend.triton_server.request_parser import parse_request
from frontend.openai_api.protocol import CompletionRequest
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint


def req(params: SamplingParams) -> RequestState:
    return RequestState(request_id="r", prompt_token_ids=[1], sampling_params=params, max_tokens=100,
                        eos_token_ids=frozenset([0]))


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scores = logits[None] / p.temperature
    if p.top_k > 0:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.typical_p < 1.0:
        scores = TypicalLogitsWarper(p.typical_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def test_distributions_match_transformers_warper_in_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=t, typical_p=m, top_k=k)
              for t in (0.6, 1.0, 1.7) for m in (0.05, 0.3, 0.8, 0.95, 1.0) for k in (-1, 20)]
    params.append(SamplingParams(temperature=0))            # a greedy row rides along
    requests = [req(p) for p in params]
    for trial in range(5):
        logits = torch.randn(len(params), 50, generator=g) * (1 + trial)
        sampler = Sampler(trial)
        _, probs = sampler.distributions(logits, sampler.prepare(requests, 50))
        for i, p in enumerate(params[:-1]):
            got = probs[i] / probs[i].sum()
            want = hf_probs(logits[i], p)
            assert torch.equal(got > 0, want > 0), f"{p}: kept tokens differ"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_rows_without_it_are_unchanged_bit_for_bit():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)) * 3
    off = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.2, min_p=0.05)]
    sampler = Sampler(0)
    _, alone = sampler.distributions(logits[:2], sampler.prepare([req(p) for p in off], 40))
    mixed = [req(p) for p in off] + [req(SamplingParams(temperature=1.0, typical_p=0.5))]
    batch = sampler.prepare(mixed, 40)
    assert batch.processors                 # the third row turns typical_p on for the step
    _, together = sampler.distributions(logits, batch)
    assert torch.equal(together[:2], alone)
    assert (together[2] == 0).sum() > 0


def test_generate_matches_transformers_sampling(ckpt_dir):
    """With a tiny typical_p (below any token's probability) one token survives each step
    (the one whose surprisal is closest to the entropy), so sampling is deterministic and comparable with
    transformers' generate token for token; it is not the greedy output."""
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    prompts = random_prompts(4, [1, 23, 9, 40], seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=True,
                                 typical_p=1e-6, top_k=0, attention_mask=torch.ones(1, len(p), dtype=torch.long))
            expected.append(ids[0, len(p):].tolist())
    llm = LLM(path, block_size=8, num_kv_blocks=64, max_num_batched_tokens=32)
    greedy_too = [SamplingParams(max_tokens=10, min_tokens=10, temperature=0)] * 2
    typical = [SamplingParams(max_tokens=10, min_tokens=10, temperature=1.0, typical_p=1e-6)] * len(prompts)
    outs = llm.generate(prompts + prompts[:2], typical + greedy_too)
    assert [o.token_ids for o in outs[:len(prompts)]] == expected
    assert expected != hf_greedy(path, prompts, 10)
    assert [o.token_ids for o in outs[len(prompts):]] == hf_greedy(path, prompts[:2], 10)
    assert_pool_free(llm)


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_out_of_range_is_an_error_naming_it(bad):
    with pytest.raises(SamplingParamsError, match="'typical_p'"):
        SamplingParams.create(typical_p=bad)
    with pytest.raises(ValueError, match="typical_p"):
        CompletionRequest(model="m", prompt="hi", typical_p=bad)


def test_the_openai_api_passes_it_on():
    body = CompletionRequest(model="m", prompt="hi", typical_p=0.4)
    assert SamplingParams.create(**body.sampling_parameters(4)).typical_p == 0.4
    assert CompletionRequest(model="m", prompt="hi", typical_p=None).typical_p == 1.0     # null: the default


def test_tritons_sampling_parameters_carry_it():
    def sampling(value):
        return {"text_input": np.array([b"x"], dtype=object),
                "sampling_parameters": np.array([json.dumps({"typical_p": value}).encode()], dtype=object)}
    assert parse_request(sampling("0.7")).params.typical_p == 0.7     # strings too, as vLLM's backend takes them
    with pytest.raises(InvalidRequestError, match="typical_p"):
        parse_request(sampling(2))
