"""Benchmarks, measured against peers in the same run.

    python -m benchmarks.bench offline [--num-seqs 256 ...]   # engine vs transformers, engine figures
    python -m benchmarks.bench serve --start-server [--concurrency 1,4,16,64]

`offline` prints a table and, as its last line, `throughput_ratio_vs_best_peer: X.XX`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_REPO = os.path.join(ROOT, "model_repository")
DEFAULT_CHECKPOINT = os.path.join(DEFAULT_REPO, "llm", "checkpoint")


def machine() -> str:
    return (f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def pbtxt_engine_args(model_dir: str) -> dict:
    """Engine parameters of a built model (so offline runs match the server's settings)."""
    from backend.triton_server.model_entry import read_config_pbtxt
    from backend.triton_server.serving_config import SERVER_KEYS, parameters_from_model_config
    params = parameters_from_model_config(read_config_pbtxt(model_dir))
    model = params.pop("model")
    args = {k: v for k, v in params.items() if k not in SERVER_KEYS and k != "max_queue_size"}
    return {"model": model if os.path.isabs(model) else os.path.join(model_dir, model), **args}


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows)


# ------------------------------------------------------------------- offline
def ensure_checkpoint(path: str) -> str:
    """The default model is built on first use (as `make model` does); any other missing
    checkpoint is a clear error, not a traceback."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.abspath(path) == os.path.abspath(DEFAULT_CHECKPOINT):
        print(f"# no default model yet: building it into {DEFAULT_REPO} (same as `make model-random`)", flush=True)
        from builder.__main__ import main as builder_main
        if builder_main(["default", "--repository", DEFAULT_REPO]) == 0 and os.path.isfile(
                os.path.join(path, "config.json")):
            return path
    raise SystemExit(f"no checkpoint at {path}: run `make model-random` for the default model, "
                     "or pass --checkpoint <Hugging Face checkpoint folder>")


def cmd_offline(a: argparse.Namespace) -> dict:
    from benchmarks import bench_offline as bo
    torch.set_num_threads(a.threads)
    path = ensure_checkpoint(a.checkpoint)
    from backend.models.config import load_model_config
    vocab = load_model_config(path).vocab_size
    wl = bo.Workload.random(a.num_seqs, tuple(a.input_len), tuple(a.output_len), vocab, a.seed)
    engine_args = dict(block_size=16, num_kv_blocks=a.num_kv_blocks, max_num_seqs=a.max_num_seqs,
                       max_num_batched_tokens=a.max_num_batched_tokens)
    print(f"# offline: {a.num_seqs} seqs, input {a.input_len}, output {a.output_len}, seed {a.seed}; "
          f"{wl.num_output_tokens} output tokens; {machine()}", flush=True)
    results = []
    eng, _ = bo.run_engine(path, wl, f"engine (max_num_seqs={a.max_num_seqs})", **engine_args)
    results.append(eng)
    print(f"  {eng.name}: {eng.tokens_per_s:.1f} tok/s", flush=True)
    peers = []
    if not a.skip_peers:
        for bsz in a.hf_batch_size:
            peers.append(bo.run_hf_static(path, wl, bsz))
            print(f"  {peers[-1].name}: {peers[-1].tokens_per_s:.1f} tok/s", flush=True)
        peers.append(bo.run_hf_continuous(path, wl, num_blocks=a.hf_kv_blocks))
        print(f"  {peers[-1].name}: {peers[-1].tokens_per_s:.1f} tok/s", flush=True)
    results += peers
    report: dict = {"workload": {"num_seqs": a.num_seqs, "input_len": a.input_len, "output_len": a.output_len,
                                 "seed": a.seed, "output_tokens": wl.num_output_tokens},
                    "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                    "throughput": [{"name": r.name, "seconds": r.seconds, "tokens_per_s": r.tokens_per_s}
                                   for r in results]}

    if not a.skip_figures:
        # KV utilization: a pool that cannot hold the whole demand, so the batch is full.
        kv = bo.kv_utilization(path, wl, block_size=16, num_kv_blocks=a.util_kv_blocks,
                               max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens)
        cc = bo.concurrency_vs_contiguous(wl, num_kv_tokens=a.util_kv_blocks * 16,
                                          max_model_len=a.input_len[1] + a.output_len[1], block_size=16)
        pre = bo.shared_prefix(path, num_requests=8, prefix_len=a.prefix_len, suffix_len=16, output_len=4,
                               vocab=vocab, block_size=16, num_kv_blocks=a.num_kv_blocks,
                               max_num_batched_tokens=a.max_num_batched_tokens)
        varying = bo.Workload.bimodal(a.static_num_seqs, (16, 64), (4, 32), (a.static_max_output * 3 // 4,
                                      a.static_max_output), 0.1, vocab, a.seed + 1)
        st = bo.static_vs_inflight(path, varying, block_size=16, num_kv_blocks=a.num_kv_blocks,
                                   max_num_seqs=a.static_batch, max_num_batched_tokens=a.max_num_batched_tokens)
        report["figures"] = {"kv_utilization": kv, "concurrency_at_fixed_kv": cc, "prefix_caching": pre,
                             "inflight_vs_static": st}

    rows = [("run", "seconds", "output tok/s", "vs engine")]
    for r in results:
        rows.append((r.name, f"{r.seconds:.2f}", f"{r.tokens_per_s:.1f}", f"{eng.tokens_per_s / r.tokens_per_s:.2f}x"))
    print(_table(rows))
    if "figures" in report:
        f = report["figures"]
        print(f"kv_utilization: {f['kv_utilization']['kv_utilization_mean']:.3f} "
              f"(over {f['kv_utilization']['steps_sampled']} full steps)")
        print(f"concurrent seqs at {a.util_kv_blocks * 16} KV tokens: contiguous "
              f"{f['concurrency_at_fixed_kv']['contiguous_seqs']} vs paged "
              f"{f['concurrency_at_fixed_kv']['paged_seqs_at_mean_len']} (at the trace's mean length)")
        p = f["prefix_caching"]
        print(f"prefix caching: hit rate {p['on']['hit_rate']:.3f}, mean TTFT off {p['off']['ttft_mean_s'] * 1e3:.1f} ms "
              f"-> on {p['on']['ttft_mean_s'] * 1e3:.1f} ms ({p['ttft_speedup']:.2f}x)")
        s = f["inflight_vs_static"]
        print(f"in-flight vs static batching (batch {a.static_batch}, 90% outputs 4-32, 10% "
              f"{a.static_max_output * 3 // 4}-{a.static_max_output} tokens): {s['inflight_tok_s']:.1f} vs "
              f"{s['static_tok_s']:.1f} tok/s ({s['ratio']:.2f}x)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
    if peers:
        best = max(peers, key=lambda r: r.tokens_per_s)
        ratio = eng.tokens_per_s / best.tokens_per_s
        report["throughput_ratio_vs_best_peer"] = ratio
        print(f"throughput_ratio_vs_best_peer: {ratio:.2f}")
    return report


# --------------------------------------------------------------------- serve
def cmd_serve(a: argparse.Namespace) -> dict:
    from benchmarks import bench_offline as bo
    from benchmarks.bench_serve import records_to_json, run_serving, summarize
    from clients.tritonserver import TritonServer
    model_dir = os.path.join(a.model_repository, a.model)
    engine_args = pbtxt_engine_args(model_dir)
    path = engine_args.pop("model")
    from backend.models.config import load_model_config
    vocab = load_model_config(path).vocab_size
    wl = bo.Workload.random(a.num_seqs, tuple(a.input_len), tuple(a.output_len), vocab, a.seed)
    prompts, outs = [list(p) for p in wl.prompts], list(wl.output_lens)
    report: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "engine_args": engine_args,
                    "workload": {"num_seqs": a.num_seqs, "input_len": a.input_len, "output_len": a.output_len}}
    if not a.skip_offline:
        torch.set_num_threads(a.threads)
        off, llm = bo.run_engine(path, wl, "offline engine", **engine_args)
        del llm
        report["offline_tok_s"] = off.tokens_per_s
        print(f"offline engine, same workload and engine settings: {off.tokens_per_s:.1f} tok/s", flush=True)
    server = TritonServer(a.model_repository).start() if a.start_server else None
    url = server.grpc_url if server else a.url
    try:
        _warm_up(url, a.model)
        runs = []
        if a.request_rate:
            points = [("rate", r) for r in a.request_rate]
        else:
            points = [("concurrency", c) for c in a.concurrency]
        for kind, value in points:
            recs, dur = run_serving(url, prompts, outs, a.model,
                                    concurrency=value if kind == "concurrency" else None,
                                    request_rate=value if kind == "rate" else None, seed=a.seed)
            summ = summarize(recs, dur, tuple(a.slo) if a.slo else None)
            summ[kind] = value
            if "offline_tok_s" in report:
                summ["fraction_of_offline"] = summ["output_token_throughput"] / report["offline_tok_s"]
            runs.append({"summary": summ, "records": records_to_json(recs)})
            print(f"{kind}={value}: {summ['output_token_throughput']:.1f} tok/s, "
                  f"{summ['request_throughput']:.2f} req/s, TTFT p50 {summ['ttft_s']['p50'] * 1e3:.1f} ms, "
                  f"TPOT p50 {summ['tpot_s']['p50'] * 1e3:.2f} ms, E2E p99 {summ['e2e_s']['p99']:.2f} s"
                  + (f", goodput {summ['goodput']:.2f} req/s" if "goodput" in summ else "")
                  + (f", {summ['fraction_of_offline']:.2f} of offline" if "fraction_of_offline" in summ else ""),
                  flush=True)
        report["runs"] = runs
    finally:
        if server:
            server.stop()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2)
    if a.plot and len(report["runs"]) > 1:
        plot_curve(report, a.plot)
    return report


def _warm_up(url: str, model: str) -> None:
    from clients.triton_client import StreamingRequest
    StreamingRequest(url, model).run("warm up", {"max_tokens": 2})


def plot_curve(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [r["summary"] for r in report["runs"]]
    key = "concurrency" if "concurrency" in runs[0] else "rate"
    xs = [r["output_token_throughput"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in ((axes[0], "tpot_s", "TPOT p50 (ms)"), (axes[1], "ttft_s", "TTFT p50 (ms)")):
        ys = [r[metric]["p50"] * 1e3 for r in runs]
        ax.plot(xs, ys, "o-")
        for r, x, y in zip(runs, xs, ys):
            ax.annotate(f"{key}={r[key]}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("output tokens/s (through Triton, gRPC streaming)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Throughput-latency, default model; {report['machine']}; {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("offline")
    o.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    o.add_argument("--num-seqs", type=int, default=128)
    o.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    o.add_argument("--output-len", type=int, nargs=2, default=[32, 256])
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--max-num-seqs", type=int, default=256)
    o.add_argument("--max-num-batched-tokens", type=int, default=2048)
    o.add_argument("--num-kv-blocks", type=int, default=8192)
    o.add_argument("--hf-batch-size", type=int, nargs="+", default=[64])
    o.add_argument("--hf-kv-blocks", type=int,
                   help="KV blocks (of 256 tokens) for transformers' continuous batching; default: "
                        "it sizes them from free memory, which takes seconds to set up (not timed)")
    o.add_argument("--util-kv-blocks", type=int, default=1024)
    o.add_argument("--prefix-len", type=int, default=512)
    o.add_argument("--static-num-seqs", type=int, default=128)
    o.add_argument("--static-max-output", type=int, default=512)
    o.add_argument("--static-batch", type=int, default=16)
    o.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    o.add_argument("--skip-peers", action="store_true")
    o.add_argument("--skip-figures", action="store_true")
    o.add_argument("--json")
    s = sub.add_parser("serve")
    s.add_argument("--url", default="localhost:8001")
    s.add_argument("--start-server", action="store_true", help="start tritonserver on --model-repository")
    s.add_argument("--model-repository", default=DEFAULT_REPO)
    s.add_argument("--model", default="llm")
    s.add_argument("--num-seqs", type=int, default=64)
    s.add_argument("--input-len", type=int, nargs=2, default=[32, 256])
    s.add_argument("--output-len", type=int, nargs=2, default=[32, 128])
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    s.add_argument("--request-rate", type=float, nargs="+", help="Poisson arrivals (req/s) instead of concurrency")
    s.add_argument("--slo", type=float, nargs=2, metavar=("TTFT_MS", "TPOT_MS"), default=[1000, 100])
    s.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    s.add_argument("--skip-offline", action="store_true")
    s.add_argument("--json", help="summary and raw per-request timestamps")
    s.add_argument("--plot", help="PNG of the throughput-latency curve")
    a = ap.parse_args(argv)
    (cmd_offline if a.cmd == "offline" else cmd_serve)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
