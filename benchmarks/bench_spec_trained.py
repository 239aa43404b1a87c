"""Speculative decoding on the trained target (builder/train_tiny.py) with its trained
drafters: the draft model, the EAGLE-3 head (builder/train_eagle3.py), the Medusa heads
(builder/train_medusa.py) and n-gram lookup; chains of k proposals, and trees of proposals
for the EAGLE-3 head and Medusa (`--trees`, vLLM's speculative_token_tree).
Acceptance and decode tokens/s at batch 1 and 16, against speculation off, on CPU.

    python -m benchmarks.bench_spec_trained [--prompts 16 --prompt-tokens 32 --tokens 64 --repeats 3
                                             --k 2 4 --methods draft_model eagle3 medusa ngram --batch 1 16
                                             --trees "eagle3:[(0,), (1,), (0, 0), (0, 0, 0)]" ...]

Prompts are the starts of held-out paragraphs of the bundled corpus (never trained on),
greedy, `--tokens` tokens each. At batch 1 each request runs alone; at batch B they are
sent B at a time. Every configuration runs the same requests, alternating with the
others, `repeats` times; the table shows the median tokens/s, the ratio to off, accepted
/ proposed draft tokens and the mean acceptance length (tokens per verification step,
the target's own included). Greedy speculative decoding must write the tokens that off writes:
the run counts requests whose output differs (fp32 sums in a verification step differ
from a one-token step's in the last bits, which can flip a near-tie).
"""

from __future__ import annotations

import argparse
import ast
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
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens to try")
    ap.add_argument("--methods", nargs="+", default=["draft_model", "eagle3", "medusa", "ngram"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests sent at once")
    ap.add_argument("--trees", nargs="*", default=DEFAULT_TREES,
                    help="METHOD:TREE, a speculative_token_tree for eagle3 or medusa (its node count is its k)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    from backend import LLM, SamplingParams
    from builder.train_eagle3 import build_head
    from builder.train_medusa import build_heads
    from builder.train_tiny import DRAFT, TARGET, corpus_split
    target, draft = _checkpoint(TARGET.name), _checkpoint(DRAFT.name)
    head = os.path.join(tempfile.gettempdir(), "paged_llm_tiny-llama-trained-eagle3")
    if not os.path.isfile(os.path.join(head, "model.safetensors")):
        build_head(head)
    medusa = os.path.join(tempfile.gettempdir(), "paged_llm_tiny-llama-trained-medusa")
    if not os.path.isfile(os.path.join(medusa, "medusa_lm_head.safetensors")):
        build_heads(medusa)
    drafter = {"draft_model": {"model": draft}, "eagle3": {"model": head}, "medusa": {"model": medusa},
               "ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 4}}
    engine = dict(dtype="float32", block_size=16, num_kv_blocks=1024, max_num_seqs=max(a.batch),
                  max_num_batched_tokens=512)
    llms = {"off": LLM(target, **engine)}
    for method in a.methods:
        for k in a.k:
            llms[f"{method} k={k}"] = LLM(target, speculative_config={
                "method": method, "num_speculative_tokens": k, **drafter[method]}, **engine)
    for spec in a.trees:
        method, tree = spec.split(":", 1)
        n = len(ast.literal_eval(tree))
        llms[f"{method} tree{n}"] = LLM(target, speculative_config={
            "method": method, "speculative_token_tree": tree, **drafter[method]}, **engine)
    tok = llms["off"].tokenizer
    held = [p for p in corpus_split()[1] if len(tok.encode(p)) >= a.prompt_tokens]
    prompts = [[tok.bos_token_id] + tok.encode(p)[:a.prompt_tokens - 1] for p in held[:a.prompts]]
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():                                     # warm-up
        llm.generate(prompts[0], SamplingParams(max_tokens=8, temperature=0))
    results = []
    for batch in a.batch:
        results += _run_batch(llms, prompts, params, batch, a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return {"results": results}


# Trees of 4 and 8 nodes for the EAGLE-3 head (second choices near the root, a long
# first-choice spine) and 6 for Medusa (three heads: at most three levels).
DEFAULT_TREES = ["eagle3:[(0,), (1,), (0, 0), (0, 0, 0)]",
                 "eagle3:[(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1)]",
                 "medusa:[(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0)]"]


def _run_batch(llms: dict, prompts: list, params, batch: int, a) -> list[dict]:
    import torch
    from builder.train_tiny import DRAFT, TARGET
    rates: dict[str, list[float]] = {n: [] for n in llms}
    counts: dict[str, dict[str, int]] = {}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(a.repeats):
        for name, llm in llms.items():
            before = llm.stats()
            t0, outs = time.perf_counter(), []
            for i in range(0, len(prompts), batch):               # `batch` requests at once
                outs += [o.token_ids for o in llm.generate(prompts[i:i + batch], params)]
            rates[name].append(len(prompts) * a.tokens / (time.perf_counter() - t0))
            after = llm.stats()
            counts[name] = {k: after.get(k, 0) - before.get(k, 0) for k in
                            ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                             "spec_decode_num_accepted_tokens")}
            outputs[name] = outs
    off = statistics.median(rates["off"])
    print(f"# target {TARGET.name} (4 layers, hidden 256), draft {DRAFT.name} (2 layers, hidden 128), EAGLE-3 head "
          f"(1 layer, hidden 256, 2048-token draft vocabulary), Medusa (4 heads), fp32; {len(prompts)} held-out prompts of "
          f"{a.prompt_tokens} tokens, {a.tokens} greedy tokens each, batch {batch}; {platform.machine()} "
          f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads); median of "
          f"{a.repeats} alternating runs")
    print(f"{'config':>16} {'tok/s':>8} {'vs off':>7} {'accepted':>9} {'accept len':>11} {'differ':>7}")
    results = []
    for name in llms:
        tps, c = statistics.median(rates[name]), counts[name]
        rate = c["spec_decode_num_accepted_tokens"] / c["spec_decode_num_draft_tokens"] \
            if c["spec_decode_num_draft_tokens"] else None
        per = 1 + c["spec_decode_num_accepted_tokens"] / c["spec_decode_num_drafts"] \
            if c["spec_decode_num_drafts"] else None
        differ = sum(o != r for o, r in zip(outputs[name], outputs["off"]))
        results.append({"config": name, "batch": batch, "tokens_per_s": tps, "vs_off": tps / off,
                        "acceptance_rate": rate, "mean_acceptance_length": per, "outputs_differing_from_off": differ})
        print(f"{name:>16} {tps:8.1f} {tps / off:6.2f}x {'-' if rate is None else f'{rate:.3f}':>9} "
              f"{'-' if per is None else f'{per:.2f}':>11} {differ:>7}")
    return results


if __name__ == "__main__":
    main()
