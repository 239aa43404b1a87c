"""The rejection sampler alone: its output follows the target distribution p exactly,
whatever q proposed (chi-square against p over many independent rows), and greedy rows
accept exactly the target's argmax."""

import pytest
import torch

from backend.engine.request import Request
from backend.engine.sampling.sampler import Sampler
from backend.engine.scheduling.sched_output import ScheduledRequest
from backend.engine.spec_decode.rejection_sampler import (RejectionSampler, accepted_tokens, verify_rows)
from backend.sampling_params import SamplingParams
from tests.helpers.runner_states import states_of
from tests.helpers.stats import goodness_of_fit

V = 8
N = 6000


def _request(i: int, params: SamplingParams) -> Request:
    return Request(request_id=f"r{i}", prompt_token_ids=[1, 2, 3], sampling_params=params, arrival_time=0.0,
                   max_tokens=16)


def _run(params: SamplingParams, target_logits: torch.Tensor, q: torch.Tensor, point_mass: bool, seed: int = 0):
    """N requests, each verifying one proposal drawn from q against target_logits (for
    both of its rows: the proposal's and the bonus); the first output token of each."""
    gen = torch.Generator().manual_seed(seed)
    proposals = torch.multinomial(q, N, replacement=True, generator=gen).tolist()
    sched = []
    for i, d in enumerate(proposals):
        sched.append(ScheduledRequest(_request(i, params), 2, [d], None if point_mass else q[None, :]))
    sampler = Sampler(seed=seed)
    rows = verify_rows(sched, states_of(sched))
    batch = sampler.prepare(rows, V)
    logits = target_logits.expand(len(rows), V).clone()
    rs = RejectionSampler(torch.device("cpu"))
    tokens, accepted = rs.sample(sampler, logits, batch, rs.plan(sched))
    tokens, accepted = tokens.tolist(), accepted.float().tolist()
    firsts, num_accepted = [], 0
    for i, s in enumerate(sched):
        out = accepted_tokens(s.spec_token_ids, tokens, accepted, 2 * i)
        firsts.append(out[0])
        num_accepted += len(out) - 1
    return firsts, num_accepted, sampler, batch, logits


LOGITS = torch.tensor([2.0, 1.5, 0.3, -1.0, 0.9, -0.2, 1.1, 0.0])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
], ids=["plain", "top_k", "top_p_min_p"])
@pytest.mark.parametrize("q_kind", ["agrees", "disagrees", "point_mass"])
def test_output_follows_the_target_distribution(params, q_kind):
    if q_kind == "agrees":
        q = torch.softmax(LOGITS, -1)
    elif q_kind == "disagrees":         # most mass where the target has little
        q = torch.softmax(-2 * LOGITS, -1)
    else:
        q = torch.zeros(V)
        q[3] = 1.0                      # an n-gram proposal: always token 3
    firsts, num_accepted, sampler, batch, logits = _run(params, LOGITS, q, point_mass=q_kind == "point_mass")
    _, p = sampler.distributions(logits[:1], sampler.prepare(states_of([ScheduledRequest(_request(0, params), 1)]), V))
    p = (p[0] / p[0].sum()).tolist()
    assert goodness_of_fit(firsts, p) > 1e-3
    # The acceptance rate is sum_x min(p(x), q(x)) in expectation.
    expected = torch.minimum(torch.tensor(p), q).sum().item() * N
    assert abs(num_accepted - expected) < 5 * (N * 0.25) ** 0.5 + 1


def test_greedy_rows_accept_the_argmax_and_correct_the_rest():
    params = SamplingParams(temperature=0.0)
    sched = [ScheduledRequest(_request(0, params), 4, [0, 0, 5], None),      # argmax is 0: two accepted
             ScheduledRequest(_request(1, params), 3, [4, 0], None)]         # rejected at once
    rows = verify_rows(sched, states_of(sched))
    sampler = Sampler()
    logits = LOGITS.expand(len(rows), V).clone()
    rs = RejectionSampler(torch.device("cpu"))
    tokens, accepted = rs.sample(sampler, logits, sampler.prepare(rows, V), rs.plan(sched))
    tokens, accepted = tokens.tolist(), accepted.float().tolist()
    assert accepted_tokens([0, 0, 5], tokens, accepted, 0) == [0, 0, 0]
    assert accepted_tokens([4, 0], tokens, accepted, 4) == [0]


def test_rows_see_the_proposals_before_them():
    """Penalties and min_tokens of row j count proposals 1..j as output, as decoding one
    token at a time would."""
    params = SamplingParams(temperature=0.0, repetition_penalty=100.0, min_tokens=2)
    request = Request(request_id="r", prompt_token_ids=[5], sampling_params=params, arrival_time=0.0,
                      max_tokens=16, eos_token_ids=frozenset([1]))
    sched = [ScheduledRequest(request, 3, [0, 6], None)]
    rows = verify_rows(sched, states_of(sched))
    assert [r.output_token_ids for r in rows] == [[], [0], [0, 6]]
    batch = Sampler().prepare(rows, V)
    logits = LOGITS.expand(3, V).clone()
    penalized, _ = Sampler().distributions(logits, batch)
    # Row 0: EOS banned (no output yet), token 0 free; row 1: token 0 penalized.
    assert penalized[0, 1] == float("-inf") and penalized[0, 0] == LOGITS[0]
    assert penalized[1, 0] < LOGITS[0] and penalized[2, 6] < LOGITS[6]
    assert penalized[2, 1] == LOGITS[1]              # min_tokens reached at row 2
