"""The stops a token causes on token ids (backend/engine/scheduling/stop_checker.py), alone:
EOS and stop ids only from min_tokens on (EOS not with ignore_eos), max_tokens as
"length", and a grammar's end once its reasoning is over. Stop strings are the output
side's (test_output_processor.py)."""

from backend.engine.request import FinishReason, Request
from backend.engine.scheduling.stop_checker import check_stop
from backend.sampling_params import SamplingParams

EOS = 2


def request(**params) -> Request:
    p = SamplingParams(**{"max_tokens": 5, **params})
    return Request(request_id="a", prompt_token_ids=[9], sampling_params=p, arrival_time=0.0,
                   max_tokens=p.max_tokens, eos_token_ids=frozenset({EOS}))


def generate(r: Request, tokens: list[int]) -> list:
    """The stop after each token, appended one at a time as the scheduler does."""
    out = []
    for t in tokens:
        r.output_token_ids.append(t)
        out.append(check_stop(r, t))
    return out


def test_eos_and_stop_ids_from_min_tokens_on():
    assert generate(request(), [4, EOS]) == [None, FinishReason.STOP]
    assert generate(request(stop_token_ids=[7]), [7]) == [FinishReason.STOP]
    assert generate(request(min_tokens=3, stop_token_ids=[7]), [EOS, 7, EOS]) == [None, None, FinishReason.STOP]
    assert generate(request(ignore_eos=True), [EOS, EOS]) == [None, None]


def test_max_tokens_ends_with_length():
    assert generate(request(max_tokens=3), [4, 4, 4]) == [None, None, FinishReason.LENGTH]
    assert generate(request(max_tokens=1), [EOS]) == [FinishReason.STOP]     # EOS first: a stop


class Grammar:
    """A matcher that accepts tokens below 50 and is done after `length` of them."""

    def __init__(self, length: int) -> None:
        self.accepted, self.length = [], length

    def accept_token(self, token: int) -> bool:
        if token >= 50:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def test_a_grammar_ends_the_request_after_its_reasoning():
    r = request(max_tokens=20, reasoning_end_token_ids=[30, 31])
    r.grammar, r.reasoning_ended = Grammar(length=2), False
    # The reasoning (not matched), its end marker, then two grammar tokens.
    assert generate(r, [60, 30, 31, 5, 6]) == [None, None, None, None, FinishReason.STOP]
    assert r.grammar.accepted == [5, 6]
    r = request(max_tokens=20)
    r.grammar = Grammar(length=9)
    assert generate(r, [5, 70]) == [None, FinishReason.STOP]        # a token the grammar refuses
