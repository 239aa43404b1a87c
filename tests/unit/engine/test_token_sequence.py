"""A prompt and its output read as one sequence (backend/engine/token_sequence.py): every
slice equals the concatenation's, without building it."""

import itertools

from backend.engine.token_sequence import TokenSequence


class Seq(TokenSequence):
    def __init__(self, prompt, output):
        self.prompt_token_ids, self.output_token_ids = list(prompt), list(output)


def test_slices_and_counts_equal_the_concatenations():
    for p, o in [(3, 0), (0, 3), (3, 4), (1, 1)]:
        s = Seq(range(10, 10 + p), range(50, 50 + o))
        whole = s.all_token_ids
        assert (s.num_tokens, s.num_prompt_tokens, s.num_output_tokens) == (p + o, p, o)
        for a, b in itertools.combinations_with_replacement(range(p + o + 1), 2):
            assert s.token_slice(a, b) == whole[a:b], (p, o, a, b)
        for k in range(o + 2):
            assert s.output_tail(k) == s.output_token_ids[max(0, o - k):]
