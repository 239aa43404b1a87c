"""What every registered token processor promises (base.TokenLogitsProcessor): a request
with default settings uses none; its own setting turns it on at intake (SamplingRow),
and then it moves that row's greedy token in a mixed batch while the other rows keep
theirs; a step where no row uses it costs it nothing (no data, no apply)."""

import pytest
import torch

from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.bad_words import BadWords
from backend.engine.sampling.logits_processors import TOKEN_PROCESSORS
from backend.engine.sampling.sampler import Sampler
from backend.engine.sampling.sampling_row import SamplingRow
from backend.sampling_params import SamplingParams
from tests.helpers.sampling import sample_ids

V = 8
LOGITS = torch.tensor([0.0, 5.0, 1.0, 2.0, 3.0, 4.0, 0.5, 0.2])     # greedy: token 1
# Settings that turn each processor on and move the greedy token away from 1 (token 1
# is the request's EOS, generated once already).
ON = {
    "logit_bias": dict(logit_bias={1: -10.0}),
    "penalties": dict(repetition_penalty=4.0),
    "min_tokens": dict(min_tokens=5),
    "bad_words": dict(bad_words_token_ids=[[1]]),
}


def state(**params) -> RequestState:
    p = SamplingParams(temperature=0.0, **params)
    r = RequestState(request_id="r", prompt_token_ids=[3], sampling_params=p, max_tokens=10,
                     eos_token_ids=frozenset({1}),
                     bad_words=BadWords.from_sequences(p.bad_words_token_ids) if p.bad_words_token_ids else None)
    r.output_token_ids = [1]
    return r


def test_every_processor_has_settings_here_and_a_unique_name():
    names = [cls.name for cls in TOKEN_PROCESSORS]
    assert len(set(names)) == len(names) and set(names) == set(ON)


def test_default_settings_use_none():
    assert SamplingRow.of(SamplingParams(), [1], V).token_processors == ()
    batch = Sampler(0).prepare([state(), state()], V)
    assert batch.token_processors == []


@pytest.mark.parametrize("cls", TOKEN_PROCESSORS, ids=[c.name for c in TOKEN_PROCESSORS])
def test_its_setting_turns_it_on_and_moves_only_its_row(cls):
    k = TOKEN_PROCESSORS.index(cls)
    on = state(**ON[cls.name])
    assert SamplingRow.of(on.sampling_params, [1], V).token_processors == (k,)
    rows = [state(), on, state()]
    batch = Sampler(0).prepare(rows, V)
    assert [proc.name for proc, _ in batch.token_processors] == [cls.name]
    assert sample_ids(Sampler(0), LOGITS.repeat(3, 1), rows) == [1, 5, 1]
