"""Speculative decoding with the trained draft on the trained target (builder/train_tiny.py):
acceptance rate and decode tokens/s at batch 1, against speculation off, on CPU.

    python -m benchmarks.bench_spec_trained [--prompts 8 --prompt-tokens 32 --tokens 64 --repeats 3 --k 2 4]

Prompts are the starts of held-out paragraphs of the bundled corpus (never trained on);
each request runs alone (batch 1), greedy, `--tokens` tokens. Every configuration runs
the same requests, alternating with the others, `repeats` times; the table shows the
median tokens/s, the ratio to off, accepted / proposed draft tokens and tokens per
verification step. Greedy speculative decoding must write the tokens that off writes:
the run counts requests whose output differs (fp32 sums in a verification step differ
from a one-token step's in the last bits, which can flip a near-tie).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time


def _checkpoint(name: str) -> str:
    from builder.train_tiny import build_trained
    path = os.path.join(tempfile.gettempdir(), f"paged_llm_{name}")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        build_trained(path, name)
    return path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens to try")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    import torch

    from backend import LLM, SamplingParams
    from builder.train_tiny import DRAFT, TARGET, corpus_split
    target, draft = _checkpoint(TARGET.name), _checkpoint(DRAFT.name)
    engine = dict(dtype="float32", block_size=16, num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
    llms = {"off": LLM(target, **engine)}
    for k in a.k:
        llms[f"draft k={k}"] = LLM(target, speculative_config={"method": "draft_model", "model": draft,
                                                               "num_speculative_tokens": k}, **engine)
    tok = llms["off"].tokenizer
    held = [p for p in corpus_split()[1] if len(tok.encode(p)) >= a.prompt_tokens]
    prompts = [[tok.bos_token_id] + tok.encode(p)[:a.prompt_tokens - 1] for p in held[:a.prompts]]
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():                                     # warm-up
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0))
    rates: dict[str, list[float]] = {n: [] for n in llms}
    counts: dict[str, dict[str, int]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(a.repeats):
        for name, llm in llms.items():
            before = llm.stats()
            t0, outs = time.perf_counter(), []
            for p in prompts:                                     # batch 1: one request at a time
                outs.append(llm.generate(p, params)[0].token_ids)
            rates[name].append(len(prompts) * a.tokens / (time.perf_counter() - t0))
            after = llm.stats()
            counts[name] = {k: after.get(k, 0) - before.get(k, 0) for k in
                            ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                             "spec_decode_num_accepted_tokens")}
            outputs[name] = outs
    off = statistics.median(rates["off"])
    print(f"# target {TARGET.name} (4 layers, hidden 256), draft {DRAFT.name} (2 layers, hidden 128), fp32; "
          f"{len(prompts)} held-out prompts of {a.prompt_tokens} tokens, {a.tokens} greedy tokens each, batch 1; "
          f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} "
          f"threads); median of {a.repeats} alternating runs")
    print(f"{'config':>12} {'tok/s':>8} {'vs off':>7} {'accepted':>9} {'tok/verify':>11} {'differ':>7}")
    results = []
    for name in llms:
        tps, c = statistics.median(rates[name]), counts[name]
        rate = c["spec_decode_num_accepted_tokens"] / c["spec_decode_num_draft_tokens"] \
            if c["spec_decode_num_draft_tokens"] else None
        per = 1 + c["spec_decode_num_accepted_tokens"] / c["spec_decode_num_drafts"] \
            if c["spec_decode_num_drafts"] else None
        differ = sum(o != r for o, r in zip(outputs[name], outputs["off"]))
        results.append({"config": name, "tokens_per_s": tps, "vs_off": tps / off, "acceptance_rate": rate,
                        "tokens_per_verification": per, "outputs_differing_from_off": differ})
        print(f"{name:>12} {tps:8.1f} {tps / off:6.2f}x {'-' if rate is None else f'{rate:.3f}':>9} "
              f"{'-' if per is None else f'{per:.2f}':>11} {differ:>7}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return {"results": results}


if __name__ == "__main__":
    main()
