"""Decode step time with the model split over two ranks vs one, and the share of rank 0's
step spent in the collectives (the layers' all-reduces and the logits gather), side by
side in one run.

    python -m benchmarks.bench_tp [--batches 1 16 --steps 40 --hidden 1024 --layers 8 --repeats 3]

Builds a random-weight Llama checkpoint of the given size (fp32), runs the same pure
decode workload at each batch size with tensor_parallel_size 1 and 2, alternating, and
prints milliseconds per decode step (median over repeats), the TP=2 / TP=1 ratio and, for
TP=2, the milliseconds per step rank 0 spends inside collectives (communication plus
waiting for the other rank to reach them) and sending the step plan, and one all-reduce
of the same size timed alone between two idle processes (the communication itself). On CPU the ranks share the machine's cores (each takes cores / ranks threads), so
the comparison is at equal hardware. One GPU cannot run TP=2; on a machine with two the
same command measures NCCL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np


def add_model_args(ap: argparse.ArgumentParser, vocab: int) -> None:
    """The random Llama's shape, as bench_tp and bench_pp take it."""
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--checkpoint", help="use this checkpoint instead of building one")


def checkpoint_from_args(args: argparse.Namespace, name: str) -> str:
    """--checkpoint, or the random Llama of the given shape (built once, kept in the temp dir)."""
    return args.checkpoint or make_checkpoint(os.path.join(tempfile.gettempdir(), name), args.hidden, args.layers,
                                              args.heads, args.kv_heads, args.vocab)


def make_checkpoint(path: str, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, torch_dtype="float32")
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


class CollectiveTimer:
    """Wall time rank 0 spends in torch.distributed calls (wrapped in this process only)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist, self.seconds, self._orig = dist, {"collectives": 0.0, "plan": 0.0}, {}

    def __enter__(self) -> "CollectiveTimer":
        for name, kind in (("all_reduce", "collectives"), ("gather", "collectives"), ("broadcast", "plan")):
            orig = getattr(self.dist, name)
            self._orig[name] = orig

            def timed(*a, _orig=orig, _kind=kind, **kw):
                t0 = time.perf_counter()
                try:
                    return _orig(*a, **kw)
                finally:
                    self.seconds[_kind] += time.perf_counter() - t0
            setattr(self.dist, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, orig in self._orig.items():
            setattr(self.dist, name, orig)


def _allreduce_rank(rank: int, init: str, shape: tuple[int, int], n: int, out) -> None:
    import datetime
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    x = torch.ones(shape)
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(1e3 * statistics.median(times))
    dist.destroy_process_group()


def allreduce_ms(shape: tuple[int, int], n: int = 200) -> float:
    """One all-reduce of `shape` fp32 between two otherwise idle processes (ms, median):
    the communication alone, without waiting for a slower rank."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    init = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
    out = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, init, shape, n, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=120)
    for p in procs:
        p.join()
    return result


def decode_ms(llm, batch: int, steps: int, prompt_len: int = 32, seed: int = 0) -> tuple[float, dict[str, float]]:
    """Median ms per pure-decode step of `batch` sequences, and ms per step in
    collectives / plan sends (rank 0)."""
    from backend import SamplingParams
    engine = llm.engine
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=steps + 2, min_tokens=steps + 2, temperature=0)
    for _ in range(batch):
        engine.add_request(rng.integers(3, engine.model_config.vocab_size, prompt_len).tolist(), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()                                    # prompts (and the first token)
    times = []
    with CollectiveTimer() as timer:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * statistics.median(times), {k: 1e3 * v / steps for k, v in timer.seconds.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    add_model_args(ap, vocab=32000)
    args = ap.parse_args(argv)
    from backend import LLM
    path = checkpoint_from_args(args, f"paged_llm_bench_tp_{args.hidden}x{args.layers}")
    results: dict[tuple[int, int], list[tuple[float, dict]]] = {}
    for _ in range(args.repeats):
        for tp in (1, 2):
            with LLM(path, dtype="float32", tensor_parallel_size=tp, block_size=16, num_kv_blocks=2048,
                     max_num_seqs=max(args.batches), enable_prefix_caching=False) as llm:
                for batch in args.batches:
                    results.setdefault((tp, batch), []).append(decode_ms(llm, batch, args.steps))
    print(f"checkpoint {path}: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} KV "
          f"heads, vocab {args.vocab}, fp32, {os.cpu_count()} cores; median of {args.repeats} alternating runs")
    per_step = 2 * args.layers + 1          # o_proj and down_proj per layer, the embedding (+ the logits gather)
    print(f"{'batch':>5} {'TP=1 ms/step':>13} {'TP=2 ms/step':>13} {'TP2/TP1':>8} {'collectives ms':>15} "
          f"{'share':>6} {'plan ms':>8} {'all-reduce alone ms':>20} {'x' + str(per_step) + ' share':>10}")
    for batch in args.batches:
        one = statistics.median(ms for ms, _ in results[(1, batch)])
        runs = results[(2, batch)]
        two = statistics.median(ms for ms, _ in runs)
        coll = statistics.median(t["collectives"] for _, t in runs)
        plan = statistics.median(t["plan"] for _, t in runs)
        alone = allreduce_ms((batch, args.hidden))
        print(f"{batch:>5} {one:>13.2f} {two:>13.2f} {two / one:>8.2f} {coll:>15.2f} {coll / two:>6.0%} {plan:>8.2f} "
              f"{alone:>20.3f} {alone * per_step / two:>10.0%}")


if __name__ == "__main__":
    main()
