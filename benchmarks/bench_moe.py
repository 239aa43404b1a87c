"""Decode step of a mixture-of-experts model against a dense model with the same active
parameters per token (issue 29), side by side in one run.

    python -m benchmarks.bench_moe [--batches 1 16 --steps 40 --hidden 1024 --layers 8 --experts 8 --top-k 2]

Builds two random-weight checkpoints (fp32): a Mixtral-shaped MoE (E experts of
`--expert-inter` channels, top-k) and a Llama whose MLP has top_k * expert-inter
channels, so a token runs through the same number of weights in both (the router's
[E, H] aside). Runs the same pure-decode workload on each, alternating, and prints ms per
decode step (median over repeats), the ratio, and the MLP weights each step has to read:
all of the dense MLP, but for the MoE every expert that at least one of the batch's
tokens picked (expected E * (1 - (1 - k/E)^B) of E per layer for B tokens routed
uniformly), which is what the batch-1 and batch-16 figures show.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from benchmarks.bench_tp import decode_ms


def make_checkpoints(root: str, hidden: int, layers: int, experts: int, top_k: int, inter: int,
                     vocab: int) -> tuple[str, str]:
    import torch
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=16,
                  num_key_value_heads=4, max_position_embeddings=2048, dtype="float32")
    moe, dense = os.path.join(root, "moe"), os.path.join(root, "dense")
    if not os.path.isfile(os.path.join(moe, "config.json")):
        torch.manual_seed(0)
        tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=inter, num_local_experts=experts,
                                               num_experts_per_tok=top_k, **common)).save_pretrained(moe)
    if not os.path.isfile(os.path.join(dense, "config.json")):
        torch.manual_seed(0)
        tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=top_k * inter, **common)).save_pretrained(dense)
    return moe, dense


def experts_read(experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts per layer that B uniformly routed tokens pick."""
    return experts * (1 - (1 - top_k / experts) ** batch)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-inter", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    args = ap.parse_args(argv)
    from backend import LLM
    root = os.path.join(tempfile.gettempdir(), f"paged_llm_bench_moe_{args.hidden}x{args.layers}_{args.experts}"
                                               f"e{args.top_k}k{args.expert_inter}")
    paths = dict(zip(("moe", "dense"), make_checkpoints(root, args.hidden, args.layers, args.experts, args.top_k,
                                                        args.expert_inter, args.vocab)))
    results: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for kind, path in paths.items():
            with LLM(path, dtype="float32", block_size=16, num_kv_blocks=1024, max_num_seqs=max(args.batches),
                     enable_prefix_caching=False) as llm:
                for batch in args.batches:
                    results.setdefault((kind, batch), []).append(decode_ms(llm, batch, args.steps)[0])
    mlp_mb = 3 * args.hidden * args.expert_inter * 4 / 2**20         # one expert, fp32
    print(f"hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, {os.cpu_count()} cores; MoE "
          f"{args.experts} experts x {args.expert_inter} channels, top-{args.top_k}; dense MLP "
          f"{args.top_k * args.expert_inter} channels; median of {args.repeats} alternating runs")
    print(f"{'batch':>5} {'dense ms/step':>14} {'MoE ms/step':>12} {'MoE/dense':>10} "
          f"{'MLP MB read/layer: dense':>25} {'MoE (expected)':>15}")
    for batch in args.batches:
        dense = statistics.median(results[("dense", batch)])
        moe = statistics.median(results[("moe", batch)])
        print(f"{batch:>5} {dense:>14.2f} {moe:>12.2f} {moe / dense:>10.2f} {args.top_k * mlp_mb:>25.1f} "
              f"{experts_read(args.experts, args.top_k, batch) * mlp_mb:>15.1f}")


if __name__ == "__main__":
    main()
