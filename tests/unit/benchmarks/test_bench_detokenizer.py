"""benchmarks/bench_detokenizer.py as a proxy: a token's text with logprob candidates
costs about the same at the 2,000th token as at the first (the median of 300 tokens each,
in one run). Before candidates' peeks copied only the window, it grew about 4x by the
4,000th token."""

import statistics

from benchmarks.bench_detokenizer import per_token_us


def test_a_tokens_text_does_not_grow_with_the_output(tiny_ckpt):
    times = per_token_us(tiny_ckpt, 2000, 5)
    early, late = statistics.median(times[:300]), statistics.median(times[-300:])
    assert late < 2.0 * early, (early, late)
