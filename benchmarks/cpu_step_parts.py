"""Where a CPU decode step's time goes, timed inside the engine: the figures behind
docs/archive/benchmarks.md section 16's "where the rest goes".

    python -m benchmarks.cpu_step_parts [--model llama-1024] [--num-seqs 32 --prompt-len 200 --steps 20]

Builds the offline engine as `benchmarks.bench_vllm_peer` does (fp32, every core), fills
it with `--num-seqs` greedy requests of `--prompt-len` random tokens, runs their prompts
and a few decode steps, then times `--steps` decode steps with a clock around each of
the parts below (patched in here, before the engine is built: nothing in serving code
measures itself). A clock costs about a microsecond a call, some 0.1 ms a step.

- `linear <name>`: the decoder's oneDNN-packed projections, summed over the layers
  (weights streamed from memory: a step's weights do not fit the last-level cache);
- `lm_head`, `decode attention` (the C++ kernel), `k/v writes`, `add + rms norm`,
  `rotary`, `silu and mul`;
- `python in the forward`: the forward's time that none of those account for (module
  calls, argument checks, views, the embedding);
- `host outside the forward`: the step's time outside the forward and the LM head
  (scheduling, step inputs, sampling, the update, outputs).

It also prints the process's resident memory once the engine is built (anonymous and
file-backed: a checkpoint file's mapping counts in the second).

Last (unless `--no-probe`): a two-thread matmul back to back against the same after
300 us of serial work on the calling thread, when the OpenMP worker has gone to sleep
(PASSIVE): what waking it adds to each parallel region after a serial stretch.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import tempfile
import time

import backend  # noqa: F401  (first: PASSIVE OpenMP and THP, as the engine runs)

ACC: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def _timed(key, fn):
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            name = key(a) if callable(key) else key
            ACC[name] += time.perf_counter() - t
            CALLS[name] += 1
    return wrapped


@contextlib.contextmanager
def instrumented():
    """Clocks around the parts while the block runs (module functions are looked up when
    the model is built, so the engine is built inside it); the originals come back after."""
    patches = clocked()
    originals = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, key in patches:
            setattr(owner, name, _timed(key, getattr(owner, name)))
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def clocked() -> list:
    """(owner, attribute, part) of each function the clocks go around."""
    from backend.attention import cpu_decode
    from backend.engine import llm_engine
    from backend.engine.runner import model_runner
    from backend.models import cpu_packed_linear, llama
    from backend.ops import cpu_layer_ops
    return [(cpu_decode, "paged_decode", "decode attention"), (cpu_decode, "write_kv", "k/v writes"),
            (cpu_layer_ops, "add_rms_norm", "add + rms norm"), (cpu_layer_ops, "rotary", "rotary"),
            (cpu_layer_ops, "act_and_mul", "silu and mul"),
            (cpu_packed_linear.PackedLinear, "forward", lambda a: getattr(a[0], "bench_name", "linear")),
            (llama.CausalLM, "forward", "forward"), (llama.CausalLM, "compute_logits", "logits"),
            (llm_engine.LLMEngine, "step", "step"), (model_runner.ModelRunner, "sample", "  of which sampling")]


def resident_mb() -> dict[str, float]:
    """This process's resident memory, anonymous and file-backed (Linux; else empty)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    return {name: int(fields[key].split()[0]) / 1024 for name, key in (("anonymous", "RssAnon"), ("file", "RssFile"))
            if key in fields}


def name_linears(model) -> None:
    from backend.models.cpu_packed_linear import PackedLinear
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            m.bench_name = "lm_head" if name.endswith("lm_head") else f"linear {name.rsplit('.', 1)[-1]}"


def wake_probe(rows: int = 32, n: int = 1024, gap_us: float = 300.0, reps: int = 400) -> tuple[float, float]:
    """(us per [rows x n] @ [n x n] matmul back to back, the same after `gap_us` of
    serial work on this thread)."""
    import torch
    from benchmarks.attention_bench import _time_ms
    a, b = torch.randn(rows, n), torch.randn(n, n)
    back_to_back = _time_ms(lambda: torch.mm(a, b), reps, torch.device("cpu")) * 1e-3
    total = 0.0
    for _ in range(reps):
        end = time.perf_counter() + gap_us * 1e-6
        while time.perf_counter() < end:    # serial work: the OpenMP worker goes to sleep
            pass
        t = time.perf_counter()
        torch.mm(a, b)
        total += time.perf_counter() - t
    return back_to_back * 1e6, total / reps * 1e6


def measure(model: str, num_seqs: int, prompt_len: int, steps: int,
            on_drained=None) -> dict[str, tuple[float, int]]:
    """{part: (ms per decode step, calls per step)} over `steps` decode steps, with
    `python in the forward` and `host outside the forward` derived. on_drained(engine):
    called once every request has finished, before the engine shuts down."""
    from backend import LLM, SamplingParams
    ACC.clear()
    CALLS.clear()
    with instrumented():
        llm = LLM(model, block_size=16, max_num_seqs=num_seqs, max_num_batched_tokens=2048,
                  num_kv_blocks=num_seqs * -(-(prompt_len + steps + 16) // 16) + 16)
        engine = llm.engine
        from backend.models.llama import CausalLM
        model_class = type(engine.runner.model)
        if any(getattr(model_class, f) is not CausalLM.__dict__[f] for f in ("forward", "compute_logits")):
            raise SystemExit(f"{model_class.__name__} has its own forward: this client clocks the Llama family's "
                             "(CausalLM.forward and compute_logits)")
        memory = resident_mb()
        name_linears(engine.runner.model)
        vocab = engine.runner.model.config.vocab_size
        rng = random.Random(0)
        for _ in range(num_seqs):
            engine.add_request([rng.randrange(10, vocab) for _ in range(prompt_len)],
                               SamplingParams(max_tokens=steps + 8, min_tokens=steps + 8, temperature=0,
                                              ignore_eos=True))
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.requests.values()):
            engine.step()
        for _ in range(3):
            engine.step()
        ACC.clear()
        CALLS.clear()
        for _ in range(steps):
            engine.step()
        parts = {k: (v / steps * 1e3, CALLS[k] // steps) for k, v in ACC.items()}
        while engine.has_unfinished_requests():
            engine.step()
        if on_drained is not None:
            on_drained(engine)
        engine.shutdown()
    inside = sum(ms for k, (ms, _) in parts.items() if k not in OUTER)
    parts["python in the forward"] = (parts["forward"][0] - inside, 0)
    parts.update({f"resident after load, MB: {k}": (v, 0) for k, v in memory.items()})
    parts["host outside the forward"] = (parts["step"][0] - parts["forward"][0] - parts["logits"][0], 0)
    return parts


# Clocks that contain others: not parts of the forward's own sum.
OUTER = ("step", "forward", "logits", "lm_head", "  of which sampling")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-1024",
                    help="checkpoint folder, or `llama-1024` (benchmarks.bench_vllm_peer's random Llama)")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-probe", dest="probe", action="store_false")
    a = ap.parse_args()
    import torch
    from benchmarks.bench_vllm_peer import make_llama_1024
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    model = make_llama_1024(os.path.join(tempfile.gettempdir(), "paged_llm_llama1024")) \
        if a.model == "llama-1024" else a.model
    parts = measure(model, a.num_seqs, a.prompt_len, a.steps)
    print(f"model {a.model}: {a.num_seqs} sequences, ~{a.prompt_len + 5} tokens of context, {a.steps} decode "
          f"steps, {torch.get_num_threads()} threads")
    print(f"step_ms: {parts['step'][0]:.2f}")
    memory = [k for k in parts if k.startswith("resident")]
    shown = sorted((k for k in parts if k not in ("step", "forward", "logits", "  of which sampling", *memory)),
                   key=lambda k: -parts[k][0]) + ["  of which sampling"]
    for k in shown:
        ms, calls = parts[k]
        print(f"  {k:26s} {ms:6.2f} ms" + (f"  ({calls} calls)" if calls > 1 else ""))
    for k in memory:
        print(f"{k}: {parts[k][0]:.0f}")
    if a.probe:
        back, after_gap = wake_probe()
        print(f"parallel region (32 x 1024 x 1024 matmul): {back:.1f} us back to back, {after_gap:.1f} us after "
              f"300 us of serial work ({after_gap - back:+.1f} us)")


if __name__ == "__main__":
    main()
