"""Offline throughput side by side with vLLM-CPU, quiet and with one core taken.

The `benchmarks.bench offline` workload (random token ids, in/out lengths uniform in ranges,
greedy, EOS ignored, min_tokens = max_tokens, fp32) runs through our engine
(`backend.LLM`) and through vLLM-CPU, each run in its own process, interleaved
(ours, vllm, ours, vllm, ...). vLLM runs under $HOME/vllm-cpu/bin/python (see
/work/shared/notes/vllm-cpu-peer.md); it is never imported in the project's venv.
Each run times one generate() after a 2-token warm-up and counts the CPU seconds of its
process tree (psutil) over that call.

    .venv/bin/python -m benchmarks.bench_vllm_peer --repeats 3
    .venv/bin/python -m benchmarks.bench_vllm_peer --repeats 3 --busy
    .venv/bin/python -m benchmarks.bench_vllm_peer --model llama-1024 --num-seqs 32
    .venv/bin/python -m benchmarks.bench_vllm_peer --variants ours ours:OMP_NUM_THREADS=1 \\
        ours:OMP_WAIT_POLICY=PASSIVE vllm vllm:VLLM_CPU_OMP_THREADS_BIND=0-1

A variant is `ours` or `vllm`, then optionally `:KEY=VAL,KEY=VAL` environment settings
for its process; the pseudo-key `taskset=CPUS` pins that process (and its children), and
for `ours` a lower-case key is an engine argument (`ours:cpu_forward_shards=1`).
For `ours`, OMP_NUM_THREADS also sets torch.set_num_threads (default: all cores, as
`benchmarks.bench offline`). Since 0eedc80 importing `clients` or `backend` sets
OMP_WAIT_POLICY=PASSIVE; `ours:GOMP_SPINCOUNT=300000` gives libgomp's old spinning
default back. `--busy` starts one `while True: pass` process pinned to core 1
(`--busy-cpu`) for the duration of each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CHECKPOINT = os.path.join(ROOT, "model_repository", "llm", "checkpoint")
VLLM_PYTHON = os.path.join(os.path.expanduser("~"), "vllm-cpu", "bin", "python")
LLAMA_1024 = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                  initializer_range=0.25, bos_token_id=1, eos_token_id=2)


# ------------------------------------------------------------------ workers (one run each)
def _tree_cpu_s() -> float:
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me] + me.children(recursive=True):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def _kv_blocks_bytes(cfg: dict, num_blocks: int, block_size: int) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    return num_blocks * block_size * per_token


def worker_ours(job: dict) -> dict:
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    from backend import LLM, SamplingParams
    llm = LLM(job["model"], block_size=job["block_size"], num_kv_blocks=job["num_kv_blocks"],
              max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              **json.loads(os.environ.get("BENCH_ENGINE_ARGS", "{}")))
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True) for n in job["outs"]]
    llm.generate([job["prompts"][0][:8]], SamplingParams(max_tokens=2))        # warm-up
    return _timed(lambda: llm.generate(job["prompts"], params), lambda outs: [len(o.token_ids) for o in outs],
                  threads=torch.get_num_threads())


def worker_vllm(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    cfg = json.load(open(os.path.join(job["model"], "config.json")))
    has_tok = os.path.isfile(os.path.join(job["model"], "tokenizer.json"))
    llm = LLM(model=job["model"], dtype="float32", max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=2048,
              kv_cache_memory_bytes=_kv_blocks_bytes(cfg, job["num_kv_blocks"], job["block_size"]),
              seed=0, skip_tokenizer_init=not has_tok)
    params = [SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True, detokenize=has_tok)
              for n in job["outs"]]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0][:8])],
                 SamplingParams(max_tokens=2, detokenize=has_tok), use_tqdm=False)       # warm-up
    return _timed(lambda: llm.generate(prompts, params, use_tqdm=False),
                  lambda outs: [len(o.outputs[0].token_ids) for o in outs])


def _timed(gen, lengths, **extra) -> dict:
    cpu0, t0 = _tree_cpu_s(), time.perf_counter()
    outs = gen()
    dt, cpu = time.perf_counter() - t0, _tree_cpu_s() - cpu0
    return {"seconds": dt, "cpu_s": cpu, "tokens": sum(lengths(outs)), **extra}


# ------------------------------------------------------------------ driver
def make_llama_1024(path: str) -> str:
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        import transformers as tf
        torch.manual_seed(0)
        tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA_1024)).eval().save_pretrained(path)
    return path


def workload(model: str, num_seqs: int, in_range, out_range, seed: int) -> tuple[list, list]:
    from benchmarks.bench_offline import Workload                     # the same generator as bench offline
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    wl = Workload.random(num_seqs, tuple(in_range), tuple(out_range), vocab, seed)
    return [list(p) for p in wl.prompts], list(wl.output_lens)


def parse_variant(v: str) -> tuple[str, dict]:
    engine, _, rest = v.partition(":")
    if engine not in ("ours", "vllm"):
        raise SystemExit(f"variant {v!r}: engine must be ours or vllm")
    return engine, dict(kv.split("=", 1) for kv in rest.split(",") if kv)


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_one(variant: str, job_path: str, busy_cpu, timeout: float) -> dict:
    engine, env_over = parse_variant(variant)
    engine_args = {k: json.loads(v) for k, v in env_over.items() if k.islower() and k != "taskset"}
    env = {**os.environ, **{k: v for k, v in env_over.items() if not k.islower()},
           "BENCH_ENGINE_ARGS": json.dumps(engine_args)}
    if engine == "vllm":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        cmd = [VLLM_PYTHON, os.path.abspath(__file__), "--worker", "vllm", job_path]
    else:
        cmd = [sys.executable, "-m", "benchmarks.bench_vllm_peer", "--worker", "ours", job_path]
    if "taskset" in env_over:
        cmd = ["taskset", "-c", env_over["taskset"]] + cmd
    hog = None
    if busy_cpu is not None:
        hog = subprocess.Popen(["taskset", "-c", str(busy_cpu), sys.executable, "-c", "while True: pass"])
    load0 = load_avg()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timeout {timeout:.0f} s", "load_before": load0,
                "load_after": load_avg()}
    finally:
        if hog:
            hog.kill()
            hog.wait()
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        sys.stderr.write(p.stderr[-3000:])
        return {"variant": variant, "error": p.returncode, "load_before": load0, "load_after": load_avg()}
    r = json.loads(lines[-1][7:])
    r.update(variant=variant, tok_s=r["tokens"] / r["seconds"], tok_per_cpu_s=r["tokens"] / r["cpu_s"],
             load_before=load0, load_after=load_avg())
    return r


def summarize(results: list[dict], variants: list[str]) -> str:
    rows = [("variant", "n", "tok/s median (range)", "tok/CPU-s median (range)")]
    med = {}
    for v in variants:
        ok = [r for r in results if r["variant"] == v and "tok_s" in r]
        if not ok:
            rows.append((v, "0", "-", "-"))
            continue
        ts, tc = [r["tok_s"] for r in ok], [r["tok_per_cpu_s"] for r in ok]
        med[v] = statistics.median(ts)
        rows.append((v, str(len(ok)), f"{med[v]:.0f} ({min(ts):.0f}-{max(ts):.0f})",
                     f"{statistics.median(tc):.0f} ({min(tc):.0f}-{max(tc):.0f})"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    out = "\n".join("  ".join(c.ljust(x) for c, x in zip(r, w)) for r in rows)
    if "ours" in med and "vllm" in med:
        out += f"\nratio ours/vllm (median tok/s): {med['ours'] / med['vllm']:.2f}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_vllm_peer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "JOB"), help=argparse.SUPPRESS)
    ap.add_argument("--model", default=DEFAULT_CHECKPOINT,
                    help="checkpoint folder, or `llama-1024` (random Llama: hidden 1024, 8 layers, "
                         "16/8 heads, vocab 32000, made with transformers in a temp dir)")
    ap.add_argument("--variants", nargs="+", default=["ours", "vllm"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--busy", action="store_true", help="one CPU-bound process on --busy-cpu during each run")
    ap.add_argument("--busy-cpu", type=int, default=1)
    ap.add_argument("--num-seqs", type=int, default=128)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-kv-blocks", type=int, default=8192)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write every run's result here")
    a = ap.parse_args(argv)
    if a.worker:
        engine, job_path = a.worker
        res = (worker_ours if engine == "ours" else worker_vllm)(json.load(open(job_path)))
        print("RESULT " + json.dumps(res), flush=True)
        return 0

    model = a.model
    if model == "llama-1024":
        model = make_llama_1024(os.path.join(tempfile.gettempdir(), "paged_llm_llama1024"))
    elif os.path.abspath(model) == os.path.abspath(DEFAULT_CHECKPOINT):
        from benchmarks.bench import ensure_checkpoint
        ensure_checkpoint(model)
    prompts, outs = workload(model, a.num_seqs, a.input_len, a.output_len, a.seed)
    job = dict(model=model, prompts=prompts, outs=outs, block_size=16, num_kv_blocks=a.num_kv_blocks,
               max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)
    fd, job_path = tempfile.mkstemp(suffix=".json", prefix="peer_job_")
    with os.fdopen(fd, "w") as fh:
        json.dump(job, fh)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; {model}; {a.num_seqs} seqs, "
          f"in {a.input_len} out {a.output_len}, {sum(outs)} output tokens; {os.cpu_count()} cores; "
          f"busy={a.busy}; load {load_avg()}", flush=True)
    results = []
    try:
        for rep in range(a.repeats):
            for v in a.variants:
                r = run_one(v, job_path, a.busy_cpu if a.busy else None, a.timeout)
                results.append(r)
                figs = (f"{r['tok_s']:.0f} tok/s, {r['tok_per_cpu_s']:.0f} tok/CPU-s, {r['seconds']:.1f} s, "
                        f"{r['cpu_s']:.1f} CPU-s" if "tok_s" in r else f"FAILED rc={r['error']}")
                print(f"  [{rep}] {v}: {figs}; load {r['load_before']} -> {r['load_after']}", flush=True)
    finally:
        os.unlink(job_path)
    print(summarize(results, a.variants))
    print(f"# done {time.strftime('%H:%M:%S UTC', time.gmtime())}; load {load_avg()}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "results": results}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
