"""Host overhead of one decode step, the model left out: what a GPU waits for between
steps when the host, not the device, sets the pace.

    python -m clients.bench_host [--num-seqs 256 --prompt-len 500 --steps 50]

Runs the real engine (scheduler, block manager, step inputs, sampling-batch preparation,
stop checks, detokenization, outputs) with the forward pass and the draw replaced by a
constant token, and prints milliseconds per step at full batch."""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_ms_per_step(checkpoint: str, num_seqs: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    from backend import LLM, SamplingParams
    llm = LLM(checkpoint, device="cpu", num_kv_blocks=num_seqs * (-(-(prompt_len + steps + 2) // 16)) + 16,
              max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * prompt_len)
    engine, runner = llm.engine, llm.engine.runner

    def host_only(out):
        runner.inputs.build(out, runner._block_table_of)
        sampling = [s.request for s in out.scheduled if s.completes_prompt]
        runner.sampler.prepare(sampling, runner.vocab_size)
        return [[7] if s.completes_prompt else [] for s in out.scheduled], {}
    runner.execute = host_only
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(num_seqs):
        engine.add_request(rng.integers(3, vocab, prompt_len).tolist(),
                           SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.6))
    engine.step()                                    # every prompt in one step
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_total_blocks, "KV blocks leaked"
    return ms


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.bench_host")
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "model_repository", "llm", "checkpoint"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--steps", type=int, default=50)
    a = ap.parse_args(argv)
    from clients.bench import ensure_checkpoint
    ms = host_ms_per_step(ensure_checkpoint(a.checkpoint), a.num_seqs, a.prompt_len, a.steps)
    print(f"host ms per decode step ({a.num_seqs} sequences, model left out): {ms:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
