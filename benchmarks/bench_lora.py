"""LoRA overhead per decode step: a batch whose requests run under 1, 4 or 16 different
adapters, against the same batch on the base model, side by side in one run.

    python -m benchmarks.bench_lora [--batch 16 --tokens 64 --hidden 512 --layers 8 --rank 16]
    python -m benchmarks.bench_lora --device cuda --attention-backend triton --dtype bfloat16   # on a GPU

The model is a random-weight Llama; the adapters are PEFT-format folders (rank `--rank`,
every projection targeted) with random weights, written here. Rows:
- base (LoRA off): the engine without enable_lora.
- base rows (LoRA on): enable_lora, every request on the base model (the wrapped
  projections' cost when no row has an adapter).
- N adapters: the batch's requests spread over N adapters (max_loras = 16, all resident).

A decode step's time is (time for `tokens` tokens - time for 1 token) / (tokens - 1): the
prefill cancels out. Configurations alternate, `repeats` times; the table shows the median
and the ratio to LoRA off. `--profile` adds where the step's time goes for LoRA off and
the most adapters (kernels per step, their time, the top kernels): whether LoRA's cost is
its kernels' count or one slow kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from benchmarks.bench_steps import decode_step_ms, decode_step_profile, report

ADAPTERS = 16
MODULES = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
           ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


def make_checkpoint(path: str, hidden: int, layers: int, heads: int, vocab: int) -> str:
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=4096, initializer_range=0.25, torch_dtype="float32")
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_adapter(path: str, base: str, rank: int, seed: int) -> str:
    """A PEFT LoRA folder as PEFT writes it: adapter_config.json and
    adapter_model.safetensors with base_model.model.<module>.lora_{A,B}.weight."""
    if os.path.isfile(os.path.join(path, "adapter_model.safetensors")):
        return path
    import torch
    from safetensors.torch import save_file
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    shapes = {"q_proj": (h, h), "k_proj": (h, h), "v_proj": (h, h), "o_proj": (h, h), "gate_proj": (h, i),
              "up_proj": (h, i), "down_proj": (i, h)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for parent, proj in MODULES:
            fan_in, fan_out = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.05
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": [p for _, p in MODULES], "base_model_name_or_path": base}, f)
    return path


def _params(names: list):
    from backend import SamplingParams
    return lambda n: [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, lora_name=name) for name in names]


def step_ms(llm, prompts: list[list[int]], names: list, tokens: int) -> float:
    return decode_step_ms(llm, prompts, _params(names), tokens)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--profile", action="store_true", help="also profile a decode step of LoRA off and of the most "
                                                           "adapters")
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from backend import LLM
    tmp = tempfile.gettempdir()
    size = f"{args.hidden}x{args.layers}v{args.vocab}"
    path = make_checkpoint(os.path.join(tmp, f"paged_llm_bench_lora_{size}"), args.hidden, args.layers, args.heads,
                           args.vocab)
    adapters = {f"a{k}": make_adapter(os.path.join(tmp, f"paged_llm_bench_lora_{size}_r{args.rank}_a{k}"), path,
                                      args.rank, seed=k) for k in range(max(args.adapters))}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, args.vocab, args.prompt).tolist() for _ in range(args.batch)]
    engine = dict(dtype=args.dtype, device=args.device, attention_backend=args.attention_backend, block_size=16,
                  num_kv_blocks=args.batch * (-(-(args.prompt + args.tokens) // 16) + 1),
                  max_num_seqs=args.batch, max_num_batched_tokens=max(512, args.batch * args.prompt))
    configs = {"base (LoRA off)": (LLM(path, **engine), [None] * args.batch)}
    lora_llm = LLM(path, lora_modules=adapters, max_loras=len(adapters), max_lora_rank=args.rank, **engine)
    configs["base rows (LoRA on)"] = (lora_llm, [None] * args.batch)
    for n in args.adapters:
        configs[f"{n} adapter{'s' if n > 1 else ''}"] = (lora_llm, [f"a{i % n}" for i in range(args.batch)])
    for llm, names in configs.values():     # warm-up: every adapter resident, kernels compiled
        step_ms(llm, prompts, names, 3)
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.repeats):
        for name, (llm, names) in configs.items():
            times[name].append(step_ms(llm, prompts, names, args.tokens))
    print(f"model {path}: Llama, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, {args.dtype}, "
          f"device {lora_llm.engine.device}, batch {args.batch}, rank {args.rank} on all 7 projections, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} alternating runs")
    out = {"results": report(times, "base (LoRA off)", {"batch": args.batch, "rank": args.rank}, args.json)}
    if args.profile:
        most = f"{max(args.adapters)} adapter{'s' if max(args.adapters) > 1 else ''}"
        out["profile"] = {name: decode_step_profile(configs[name][0], prompts, _params(configs[name][1]),
                                                    min(args.tokens, 16)) for name in ("base (LoRA off)", most)}
        for name, prof in out["profile"].items():
            unit = "kernels" if "device_ms_per_step" in prof else "operators"
            print(f"{name}: {prof['kernels_per_step']:.0f} {unit} a step; top: " +
                  ", ".join(f"{t['name'][:40]} {t['ms_per_step']:.3f} ms x{t['calls_per_step']:.0f}"
                            for t in prof["top"][:4]))
    return out


if __name__ == "__main__":
    main()
