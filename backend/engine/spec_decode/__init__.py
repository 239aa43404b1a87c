"""Speculative decoding: a proposer guesses each decoding request's next tokens, the
target model scores them all in the step's one packed forward (a query of k + 1 tokens
over the paged cache, like a prefill chunk), and the rejection sampler keeps the longest
prefix the target agrees with, plus one token of its own. Output is unchanged: greedy
tokens are the target's argmax, sampled ones follow the target's distribution exactly.

    speculator.py          which requests speculate, how many tokens, metrics
    ngram.py               prompt lookup over the request's own tokens
    ngram_index.py         the lookup's scan, and its index for long contexts
    draft_model.py         a smaller model with its own K/V in the target's blocks
    rejection_sampler.py   verification (greedy and the rejection-sampling rule)
"""
