"""EAGLE head checkpoints in the published layouts (the EAGLE authors' names, which vLLM
and this engine read: backend/models/eagle3.py, eagle1.py).

    python -m builder.eagle_heads --target CKPT --output DIR [--seed 0 --draft-vocab N] [--eagle1]

writes a randomly initialised EAGLE-3 head (or with --eagle1 an EAGLE-1 head) for a
Llama-family target (tests, and a starting point); builder/train_eagle3.py trains one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Optional

import torch

def default_aux_layers(num_layers: int) -> list[int]:
    """Low, middle and high layers of the target (vLLM's default where it has room)."""
    ids = sorted({2, num_layers // 2, num_layers - 3})
    if len(ids) == 3 and all(0 <= i < num_layers for i in ids):
        return ids
    return [1, num_layers // 2, num_layers - 1] if num_layers >= 4 else list(range(num_layers))[-3:]


def head_config(target: dict, draft_vocab: int, aux_layers: list[int], hidden_size: Optional[int] = None,
                intermediate_size: Optional[int] = None, num_heads: Optional[int] = None,
                num_kv_heads: Optional[int] = None) -> dict:
    """config.json of a head for the target whose config.json is `target`."""
    h = hidden_size or target["hidden_size"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": intermediate_size or target["intermediate_size"],
        "num_attention_heads": num_heads or target["num_attention_heads"],
        "num_key_value_heads": num_kv_heads or target.get("num_key_value_heads", target["num_attention_heads"]),
        "num_hidden_layers": 1, "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 10000.0), "rope_scaling": target.get("rope_scaling"),
        "max_position_embeddings": target.get("max_position_embeddings", 2048), "hidden_act": "silu",
        "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab, "target_hidden_size": target["hidden_size"],
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers)},
    }


def vocab_maps(draft_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary of the sorted target ids `draft_ids`."""
    draft_ids = torch.sort(draft_ids).values
    d2t = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def save_head(output: str, config: dict, tensors: dict[str, torch.Tensor], tokenizer_from: Optional[str] = None
              ) -> str:
    """Write config.json and model.safetensors (published names); the target's tokenizer
    beside them when given (the head has the target's vocabulary)."""
    from safetensors.torch import save_file
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(output, "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer_from:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if os.path.isfile(os.path.join(tokenizer_from, name)):
                shutil.copy(os.path.join(tokenizer_from, name), output)
    return output


def random_head(target_path: str, output: str, seed: int = 0, draft_vocab: Optional[int] = None,
                aux_layers: Optional[list[int]] = None, std: float = 0.05, **shapes) -> str:
    """A randomly initialised head for the checkpoint at `target_path` (draft vocabulary:
    `draft_vocab` target ids drawn at random, or the whole vocabulary)."""
    with open(os.path.join(target_path, "config.json")) as f:
        target = json.load(f)
    V = target["vocab_size"]
    cfg = head_config(target, draft_vocab or V, aux_layers or default_aux_layers(target["num_hidden_layers"]),
                      **shapes)
    g = torch.Generator().manual_seed(seed)
    h, th = cfg["hidden_size"], target["hidden_size"]
    head_dim = h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    inter = cfg["intermediate_size"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * std
    tensors = {
        "fc.weight": w(h, 3 * th), "midlayer.self_attn.q_proj.weight": w(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kv, 2 * h), "midlayer.self_attn.v_proj.weight": w(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, q), "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h), "midlayer.mlp.down_proj.weight": w(h, inter),
        "midlayer.hidden_norm.weight": torch.ones(h), "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h), "norm.weight": torch.ones(h),
        "lm_head.weight": w(cfg["draft_vocab_size"], h),
    }
    if draft_vocab and draft_vocab < V:
        ids = torch.randperm(V, generator=g)[:draft_vocab]
        tensors["d2t"], tensors["t2d"] = vocab_maps(ids, V)
    return save_head(output, cfg, tensors, target_path)


def random_eagle1_head(target_path: str, output: str, seed: int = 0, std: float = 0.05) -> str:
    """A randomly initialised one-layer EAGLE-1 head (the authors' layout: `fc` with a
    bias, `layers.0.*` without an input norm, the target's embedding and LM head)."""
    with open(os.path.join(target_path, "config.json")) as f:
        target = json.load(f)
    cfg = {**target, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "torch_dtype": "float32"}
    g = torch.Generator().manual_seed(seed)
    h, heads = target["hidden_size"], target["num_attention_heads"]
    d = target.get("head_dim") or h // heads
    q, kv = heads * d, target.get("num_key_value_heads", heads) * d
    inter = target["intermediate_size"]

    def w(*shape):
        return torch.randn(*shape, generator=g) * std
    tensors = {"fc.weight": w(h, 2 * h), "fc.bias": w(h),
               "layers.0.self_attn.q_proj.weight": w(q, h), "layers.0.self_attn.k_proj.weight": w(kv, h),
               "layers.0.self_attn.v_proj.weight": w(kv, h), "layers.0.self_attn.o_proj.weight": w(h, q),
               "layers.0.mlp.gate_proj.weight": w(inter, h), "layers.0.mlp.up_proj.weight": w(inter, h),
               "layers.0.mlp.down_proj.weight": w(h, inter),
               "layers.0.post_attention_layernorm.weight": torch.ones(h)}
    return save_head(output, cfg, tensors, target_path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's checkpoint folder")
    ap.add_argument("--output", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, help="a reduced draft vocabulary of this many ids (d2t)")
    ap.add_argument("--eagle1", action="store_true", help="an EAGLE-1 head (method 'eagle') instead")
    a = ap.parse_args(argv)
    print(random_eagle1_head(a.target, a.output, a.seed) if a.eagle1 else
          random_head(a.target, a.output, a.seed, a.draft_vocab))


if __name__ == "__main__":
    main()
