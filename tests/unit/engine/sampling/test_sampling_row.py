"""A request's sampling settings worked out once (backend/engine/sampling/sampling_row.py):
what each setting turns on, what the vocabulary cuts, and which token processors the
row joins (a default request joins none)."""

from backend.engine.sampling.logits_processors import TOKEN_PROCESSORS
from backend.engine.sampling.sampling_row import NO_TOP_P, SamplingRow
from backend.sampling_params import SamplingParams

V = 100


def processors(row: SamplingRow) -> set[str]:
    return {TOKEN_PROCESSORS[k].name for k in row.token_processors}


def test_a_default_greedy_request_turns_nothing_on():
    row = SamplingRow.of(SamplingParams(temperature=0), [2], V)
    assert row.greedy and not row.any_top_p and row.top_k == 0 and row.processors == 0
    assert processors(row) == set() and row.params[2] == NO_TOP_P and row.logprobs is None


def test_each_setting_turns_on_its_part():
    row = SamplingRow.of(SamplingParams(temperature=0.5, top_k=5, top_p=0.9, min_p=0.1, logprobs=3), [2], V)
    assert not row.greedy and row.top_k == 5 and row.any_top_p and row.processors and row.logprobs == 3
    assert processors(SamplingRow.of(SamplingParams(repetition_penalty=1.2), [2], V)) == {"penalties"}
    assert processors(SamplingRow.of(SamplingParams(presence_penalty=0.5), [2], V)) == {"penalties"}
    assert processors(SamplingRow.of(SamplingParams(logit_bias={5: 1.0}), [2], V)) == {"logit_bias"}


def test_the_vocabulary_cuts_top_k_and_bias_and_min_tokens_bans_stops_and_eos():
    row = SamplingRow.of(SamplingParams(top_k=V, logit_bias={5: 1.0, V + 3: 2.0}), [2], V)
    assert row.top_k == 0                                   # not below the vocabulary: no top-k
    assert (row.bias_ids, row.bias_values) == ((5,), (1.0,))
    row = SamplingRow.of(SamplingParams(min_tokens=3, stop_token_ids=[7, V + 1]), [2], V)
    assert row.min_tokens_banned == (2, 7) and processors(row) == {"min_tokens"}
    row = SamplingRow.of(SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True), [2], V)
    assert row.min_tokens_banned == (7,)
    assert processors(SamplingRow.of(SamplingParams(logit_bias={V + 3: 2.0}), [2], V)) == set()
