import math

import pytest
import torch

from backend.engine.request import Request
from backend.engine.sampler import Sampler
from backend.sampling_params import SamplingParams, SamplingParamsError


def req(params: SamplingParams, prompt=(1,), out=(), seed=None) -> Request:
    r = Request(request_id="r", prompt_token_ids=list(prompt), sampling_params=params, arrival_time=0,
                max_tokens=100, eos_token_ids=frozenset([0]))
    r.output_token_ids = list(out)
    if params.seed is not None:
        r.generator = torch.Generator().manual_seed(params.seed)
    return r


def draws(params: SamplingParams, logits: torch.Tensor, n: int = 400, **kw) -> torch.Tensor:
    s = Sampler(0)
    r = req(params, **kw)
    return torch.tensor([s(logits[None], [r])[0] for _ in range(n)])


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    p = SamplingParams(temperature=0)
    assert Sampler()(logits, [req(p), req(p)]) == [1, 0]


def test_top_k_and_top_p_and_min_p_restrict_support():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert set(draws(SamplingParams(top_k=2), logits).tolist()) == {0, 1}
    assert set(draws(SamplingParams(top_p=0.65), logits).tolist()) == {0, 1}
    assert set(draws(SamplingParams(min_p=0.6), logits).tolist()) == {0, 1}
    assert set(draws(SamplingParams(), logits).tolist()) == {0, 1, 2, 3}


def test_temperature_sharpens():
    logits = torch.log(torch.tensor([0.6, 0.4]))
    cold = draws(SamplingParams(temperature=0.2), logits, n=600).float().mean()
    hot = draws(SamplingParams(temperature=1.0), logits, n=600).float().mean()
    assert cold < hot


def test_distribution_matches_probs():
    probs = torch.tensor([0.5, 0.3, 0.2])
    d = draws(SamplingParams(seed=3), torch.log(probs), n=3000)
    freq = torch.bincount(d, minlength=3).float() / len(d)
    assert torch.allclose(freq, probs, atol=0.04)


def test_seeded_requests_reproduce_regardless_of_batch():
    logits = torch.randn(3, 50)
    p = SamplingParams(seed=42)
    a = [Sampler(0)(logits[i:i + 1], [req(p)])[0] for i in range(1)]
    r = req(p)
    s = Sampler(99)
    b = s(logits[[1, 0, 2]], [req(SamplingParams()), r, req(SamplingParams(seed=5))])
    assert b[1] == a[0]


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 1.9]])
    rep = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])
    assert Sampler()(logits, [rep]) == [1]
    freq = req(SamplingParams(temperature=0, frequency_penalty=0.2), out=[1, 1, 0])
    assert Sampler()(logits, [freq]) == [3]
    pres = req(SamplingParams(temperature=0, presence_penalty=0.15), out=[0, 1])
    assert Sampler()(logits, [pres]) == [3]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    r = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]), out=[3])
    assert Sampler()(logits, [r]) == [1]
    r = req(SamplingParams(temperature=0, min_tokens=1), out=[3])
    assert Sampler()(logits, [r]) == [0]


@pytest.mark.parametrize("bad", [
    {"temperature": -1}, {"temperature": math.nan}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
    {"max_tokens": 0}, {"min_p": 2}, {"min_tokens": 5, "max_tokens": 2}, {"stop": [""]}, {"bogus": 1},
])
def test_invalid_params_name_the_field(bad):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.create(**bad)
    key = next(iter(bad)) if "min_tokens" not in bad else "min_tokens"
    assert key in str(e.value)
