import math

import pytest
import torch

from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.sampler import NUM_COLUMNS, Sampler
from tests.helpers.sampling import sample_ids
from backend.sampling_params import SamplingParams, SamplingParamsError


def req(params: SamplingParams, prompt=(1,), out=(), seed=None) -> RequestState:
    r = RequestState(request_id="r", prompt_token_ids=list(prompt), sampling_params=params, max_tokens=100,
                     eos_token_ids=frozenset([0]))
    r.output_token_ids = list(out)
    if params.seed is not None:
        r.generator = torch.Generator().manual_seed(params.seed)
    return r


def draws(params: SamplingParams, logits: torch.Tensor, n: int = 400, **kw) -> torch.Tensor:
    s = Sampler(0)
    r = req(params, **kw)
    return torch.tensor([sample_ids(s, logits[None], [r])[0] for _ in range(n)])


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 0.0]])
    p = SamplingParams(temperature=0)
    assert sample_ids(Sampler(), logits, [req(p), req(p)]) == [1, 0]


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
    a = [sample_ids(Sampler(0), logits[i:i + 1], [req(p)])[0] for i in range(1)]
    r = req(p)
    s = Sampler(99)
    b = sample_ids(s, logits[[1, 0, 2]], [req(SamplingParams()), r, req(SamplingParams(seed=5))])
    assert b[1] == a[0]


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 1.9]])
    rep = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0])
    assert sample_ids(Sampler(), logits, [rep]) == [1]
    freq = req(SamplingParams(temperature=0, frequency_penalty=0.2), out=[1, 1, 0])
    assert sample_ids(Sampler(), logits, [freq]) == [3]
    pres = req(SamplingParams(temperature=0, presence_penalty=0.15), out=[0, 1])
    assert sample_ids(Sampler(), logits, [pres]) == [3]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 4.0, 0.0]])
    r = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2]), out=[3])
    assert sample_ids(Sampler(), logits, [r]) == [1]
    r = req(SamplingParams(temperature=0, min_tokens=1), out=[3])
    assert sample_ids(Sampler(), logits, [r]) == [0]


def test_logit_bias_shifts_only_its_rows_tokens():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    biased = req(SamplingParams(temperature=0, logit_bias={2: 5.0, 7: 100.0}))   # 7 is outside: ignored
    plain = req(SamplingParams(temperature=0))
    assert sample_ids(Sampler(), logits, [biased, plain]) == [2, 0]
    assert set(draws(SamplingParams(logit_bias={0: -100.0}), logits[0]).tolist()) == {1, 2}


@pytest.mark.parametrize("bad", [
    {"logit_bias": {1: 101.0}},
    {"temperature": -1}, {"temperature": math.nan}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
    {"max_tokens": 0}, {"min_p": 2}, {"min_tokens": 5, "max_tokens": 2}, {"stop": [""]}, {"bogus": 1},
])
def test_invalid_params_name_the_field(bad):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams.create(**bad)
    key = next(iter(bad)) if "min_tokens" not in bad else "min_tokens"
    assert key in str(e.value)


# ------------------------------------------------- batched pass vs the per-row reference
from tests.helpers.per_row_sampler import processed_logits, target_probs  # noqa: E402

MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.6),
    SamplingParams(temperature=0.9, min_p=0.15),
    SamplingParams(temperature=1.1, top_k=6, top_p=0.8, min_p=0.02, repetition_penalty=1.5,
                   presence_penalty=0.4, frequency_penalty=0.3),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5),
    SamplingParams(temperature=0.8, min_tokens=5, stop_token_ids=[3]),
]


def mixed_requests(copies: int) -> list[RequestState]:
    out = []
    for i, p in enumerate(MIXED):
        for _ in range(copies):
            out.append(req(p, prompt=[5, 6, i % 10], out=[1, 1, 7, 0]))
    return out


def test_batched_greedy_equals_per_row_argmax():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        requests = mixed_requests(2)
        logits = torch.randn(len(requests), 12, generator=g) * 3
        got = sample_ids(Sampler(trial), logits, requests)
        for i, r in enumerate(requests):
            if r.sampling_params.greedy:
                assert got[i] == int(processed_logits(logits[i], r).argmax())


def test_batched_draws_follow_the_per_row_distribution():
    """Each parameter set, sampled inside one mixed batch, draws from the distribution
    the per-row sampler defined: total variation < 0.03 over 4,000 draws (seeded, so
    deterministic), and never a token outside its support."""
    V, copies, steps = 12, 40, 100
    logits_row = torch.linspace(2.0, -1.5, V) + torch.tensor([0.3, -0.2] * (V // 2))
    requests = mixed_requests(copies)
    logits = logits_row.expand(len(requests), V).contiguous()
    sampler = Sampler(7)
    batch = sampler.prepare(requests, V)
    draws = torch.stack([sampler.sample(logits, batch) for _ in range(steps)])   # [steps, B]
    for j, params in enumerate(MIXED):
        rows = draws[:, j * copies:(j + 1) * copies].reshape(-1)
        freq = torch.bincount(rows, minlength=V).float() / rows.numel()
        expected = target_probs(logits_row, requests[j * copies])
        assert freq[expected == 0].sum() == 0, f"{params}: drew outside the support"
        tv = 0.5 * (freq - expected).abs().sum().item()
        assert tv < 0.03, f"{params}: total variation {tv:.3f}"


def test_seeded_rows_reproduce_across_batch_compositions_and_steps():
    V = 30
    logits_row = torch.randn(V, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)

    def run(companions: int, position: int) -> list[int]:
        others = [req(SamplingParams(temperature=0.5)) for _ in range(companions)]
        mine = req(p)
        requests = others[:position] + [mine] + others[position:]
        s = Sampler(companions)
        tokens = []
        for _ in range(6):
            out = sample_ids(s, logits_row.expand(len(requests), V), requests)
            tokens.append(out[position])
        return tokens

    alone = run(0, 0)
    assert run(5, 2) == alone and run(9, 9) == alone
    assert len(set(alone)) > 1                     # the draws do vary step to step


def test_one_upload_of_parameters_and_ids_stay_on_the_logits_device():
    requests = mixed_requests(1)
    s = Sampler(0)
    batch = s.prepare(requests, 12)
    assert batch.params.shape == (len(requests), NUM_COLUMNS) and batch.params.device == s.device
    repetition, counted = batch.token_data("penalties")
    banned = batch.token_data("min_tokens")
    for idx in (repetition, counted, banned):
        assert idx is not None and idx[0].device == s.device
    # The token processors' index sets share one upload.
    assert repetition[0].untyped_storage().data_ptr() == banned[1].untyped_storage().data_ptr()
    tokens = s.sample(torch.randn(len(requests), 12), batch)
    assert tokens.dtype == torch.int64 and tokens.device == s.device


def test_the_rows_settings_are_kept_while_the_batch_is_the_same():
    """The rows' part of a step (parameters, summaries, seeded and logprob rows) is worked
    out again only when the rows change (other objects, another order, another count);
    between, each step still takes the token processors' new tokens. Over steps whose
    outputs grow, with a change of batch midway, every step's processed logits and draws
    equal a sampler that works everything out every step."""
    V = 12
    requests = mixed_requests(2) + [req(SamplingParams(temperature=0.7, seed=5, logprobs=2), out=[3])]
    kept, fresh = Sampler(3), Sampler(3)
    g = torch.Generator().manual_seed(4)
    first = None
    for step in range(8):
        if step == 5:
            requests = requests[1:] + requests[:1]          # the batch changes
        logits = torch.randn(len(requests), V, generator=g) * 3
        fresh._rows = None
        a, b = kept.prepare(requests, V), fresh.prepare(requests, V)
        if step == 0:
            first = a.params
        assert (a.params is first) == (step < 5)            # kept, then worked out again
        assert torch.equal(a.params, b.params) and a.seeded == b.seeded
        assert a.logprobs.row_ids == b.logprobs.row_ids and torch.equal(a.logprobs.rows, b.logprobs.rows)
        la, pa = kept.distributions(logits, a)
        lb, pb = fresh.distributions(logits, b)
        assert torch.equal(la, lb) and torch.equal(pa, pb)
        unseeded = [i for i in range(len(requests)) if i not in dict(a.seeded)]     # (a seeded row's generator
        assert torch.equal(kept.sample(logits, a)[unseeded], fresh.sample(logits, b)[unseeded])     # is shared)
        for r in requests:
            r.output_token_ids.append(step % V)             # penalties and min_tokens move on
