"""What an EAGLE-3 step costs against a plain decode step, on a random model of a real
shape, and the speed-up that cost projects from measured acceptance lengths.

    python -m benchmarks.bench_eagle_step [--shape 1b --batch 1 16 --k 2 4 --trees tree4 tree8 --device cpu]
    python -m benchmarks.bench_eagle_step --shape 8b --batch 1 16 64 --device cuda --dtype bfloat16

A random Llama of the named shape and a random EAGLE-3 head in the published layout
(one layer of the target's width, a 32k draft vocabulary) are written once under the
temp folder. For each batch size, B requests of 128 prompt tokens decode `--tokens`
tokens each, with speculation off and with the head at each k; after every request has
its first token, the engine's steps are timed: a plain decode step against a speculative
step (the verification of k + 1 tokens a row, and the head's catch-up and k - 1
forwards inside it; for a tree of proposals, the verification of its nodes and the
head's one forward per level), as time per decoded token after every request's first
token. A random head's proposals are rejected, so each speculative round yields one
token here; the projection is

    speed-up(config) = acceptance length(config) x plain step / speculative step

with the acceptance length the trained head reaches on the trained reference model
(`docs/archive/benchmarks.md` §25; `--acceptance`), which assumes a head of this shape accepts as
much. The measured step costs are this machine's; the acceptance lengths are not.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

SHAPES = {   # hidden, intermediate, layers, heads, kv heads, vocab (Llama 3.x)
    "tiny": (256, 768, 4, 8, 4, 4096),
    "1b": (2048, 8192, 16, 32, 8, 128256),
    "8b": (4096, 14336, 32, 32, 8, 128256),
}
DRAFT_VOCAB = 32000
# Mean acceptance lengths of the trained head on the trained reference model (greedy,
# held-out prompts, batch 1, CPU: docs/archive/benchmarks.md §25), by config: chains of k
# (2026-11-29) and the trees below (bench_spec_trained's, 2026-11-30).
ACCEPTANCE = {"k2": 2.25, "k4": 2.90, "tree4": 2.76, "tree8": 3.23}
TREES = {"tree4": "[(0,), (1,), (0, 0), (0, 0, 0)]",
         "tree8": "[(0,), (1,), (0, 0), (1, 0), (0, 1), (0, 0, 0), (0, 0, 0, 0), (0, 0, 1)]"}


def random_target(shape: str, dtype: str, device: str) -> str:
    import torch
    from safetensors.torch import save_file
    h, inter, layers, heads, kv, vocab = SHAPES[shape]
    path = os.path.join(tempfile.gettempdir(), f"paged_llm_random_llama_{shape}_{dtype}")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": dtype, "hidden_act": "silu",
           "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    t = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    d = h // heads

    def w(*s):
        return (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * 0.02).to(t).cpu()
    state = {"model.embed_tokens.weight": w(vocab, h), "lm_head.weight": w(vocab, h),
             "model.norm.weight": torch.ones(h, dtype=t)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": w(heads * d, h), p + "self_attn.k_proj.weight": w(kv * d, h),
                      p + "self_attn.v_proj.weight": w(kv * d, h), p + "self_attn.o_proj.weight": w(h, heads * d),
                      p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                      p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": torch.ones(h, dtype=t),
                      p + "post_attention_layernorm.weight": torch.ones(h, dtype=t)})
    save_file(state, os.path.join(path, "model.safetensors"))
    return path


def _round_time(llm, prompts, tokens: int) -> float:
    """Seconds per decoded token of every request once each has its first token: a
    plain decode step, or with a random head (every proposal rejected: one token a
    round) a speculative round. Timed over the whole decode, not per engine step: under
    async scheduling a speculating request sits out every other step."""
    from backend import SamplingParams
    engine = llm.engine
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    started: set[str] = set()
    t0, emitted = None, 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if t0 is not None:
            emitted += sum(len(o.new_token_ids) for o in outs)
        started |= {o.request_id for o in outs if o.new_token_ids}
        if t0 is None and len(started) == len(prompts):
            t0 = time.perf_counter()
    return (time.perf_counter() - t0) / (emitted / len(prompts))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="1b")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--trees", nargs="*", default=list(TREES), choices=list(TREES))
    ap.add_argument("--tokens", type=int, default=24, help="decoded tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--acceptance", help="k2=L,tree8=L,... acceptance lengths to project from (default: the "
                                         "trained head's)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import numpy as np
    import torch

    from backend import LLM
    from builder.eagle_heads import random_head
    acceptance = dict(ACCEPTANCE) if not a.acceptance else {
        k: float(v) for k, v in (kv.split("=") for kv in a.acceptance.split(","))}
    target = random_target(a.shape, a.dtype, a.device)
    head = os.path.join(tempfile.gettempdir(), f"paged_llm_random_eagle3_{a.shape}")
    if not os.path.isfile(os.path.join(head, "model.safetensors")):
        random_head(target, head, draft_vocab=min(DRAFT_VOCAB, SHAPES[a.shape][5]), std=0.02)
    rng = np.random.default_rng(0)
    engine = dict(dtype=a.dtype, device=a.device, block_size=16, max_num_seqs=max(a.batch),
                  max_num_batched_tokens=max(2048, max(a.batch) * 128), max_model_len=1024,
                  num_kv_blocks=max(a.batch) * (128 + a.tokens + 32) // 16 + 64, enable_prefix_caching=False)
    configs = {"off": None, **{f"k{k}": {"method": "eagle3", "model": head, "num_speculative_tokens": k}
                               for k in a.k},
               **{name: {"method": "eagle3", "model": head, "speculative_token_tree": TREES[name]} for name in a.trees}}
    llms = {name: LLM(target, speculative_config=spec, **engine) for name, spec in configs.items()}
    print(f"# {a.shape}-shaped random Llama ({SHAPES[a.shape]}), random EAGLE-3 head, {a.dtype} on {a.device}; "
          f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}; time per decoded token "
          f"after every request's first token, {a.tokens} tokens a request, median of {a.repeats}; projection from "
          f"acceptance lengths {acceptance}")
    print(f"{'batch':>5} {'config':>12} {'step ms':>9} {'vs plain':>9} {'projected':>10}")
    results = []
    for batch in a.batch:
        prompts = [rng.integers(3, SHAPES[a.shape][5], 128).tolist() for _ in range(batch)]
        for llm in llms.values():                                      # warm-up
            _round_time(llm, prompts[:1], 4)
        med = {name: statistics.median(_round_time(llm, prompts, a.tokens) for _ in range(a.repeats))
               for name, llm in llms.items()}
        for name, t in med.items():
            spec = name != "off"
            proj = acceptance.get(name, 1.0) * med["off"] / t if spec else None
            results.append({"batch": batch, "config": name, "step_ms": t * 1e3, "vs_plain_step": t / med["off"],
                            "projected_speedup": proj})
            print(f"{batch:>5} {name:>12} {t * 1e3:9.2f} {t / med['off']:8.2f}x "
                  f"{'-' if not spec else f'{proj:.2f}x':>10}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)
    return {"results": results}


if __name__ == "__main__":
    main()
