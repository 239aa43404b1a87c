"""A streamed token's text with logprobs (IncrementalDetokenizer: each candidate peeked,
then the sampled token added), early in a long output and late in it, side by side in
one run: the cost per token should not grow with the output.

    python -m benchmarks.bench_detokenizer [--checkpoint PATH] [--tokens 4000] [--candidates 5] [--window 500]

Prints the median microseconds per token over the first and the last `--window` tokens
and their ratio (about 1 when the cost does not grow).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def per_token_us(checkpoint: str, tokens: int, candidates: int, seed: int = 0) -> list[float]:
    from transformers import AutoTokenizer

    from backend.engine.detokenizer import IncrementalDetokenizer, fast_decoder
    from backend.sampling_params import SamplingParams
    tok = AutoTokenizer.from_pretrained(checkpoint)
    rng = random.Random(seed)
    d = IncrementalDetokenizer(tok, [5, 6, 7], SamplingParams(), fast_decoder(tok))
    out = []
    for _ in range(tokens):
        t = rng.randrange(100, min(3000, tok.vocab_size - candidates))
        start = time.perf_counter()
        for c in range(t, t + candidates + 1):      # the sampled token and the top ones
            d.peek(c)
        d.add_token(t)
        out.append((time.perf_counter() - start) * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "model_repository", "llm", "checkpoint"))
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--candidates", type=int, default=5)
    ap.add_argument("--window", type=int, default=500)
    a = ap.parse_args()
    times = per_token_us(a.checkpoint, a.tokens, a.candidates)
    early, late = statistics.median(times[:a.window]), statistics.median(times[-a.window:])
    print(f"# {a.tokens} tokens, {a.candidates} candidates each; median us per token")
    print(f"early_us: {early:.1f}")
    print(f"late_us: {late:.1f}")
    print(f"late_over_early: {late / early:.2f}")


if __name__ == "__main__":
    main()
