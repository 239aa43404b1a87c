"""Medusa head checkpoints in the Medusa authors' layout (backend/models/medusa.py reads
it, and vLLM's).

    python -m builder.medusa_heads --target CKPT --output DIR [--heads 4 --layers 1 --seed 0]

writes randomly initialised heads for a Llama-family target (tests, and a starting
point); builder/train_medusa.py trains them.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def heads_config(target: dict, num_heads: int, num_layers: int, original_lm_head: bool) -> dict:
    return {"architectures": ["MedusaModel"], "medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
            "hidden_size": target["hidden_size"], "vocab_size": target["vocab_size"],
            "original_lm_head": original_lm_head, "torch_dtype": "float32"}


def published_names(blocks: list[list[tuple[torch.Tensor, torch.Tensor]]],
                    lm_heads: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Head i's blocks (weight, bias) and LM head under the authors' names."""
    out = {}
    for i, layers in enumerate(blocks):
        for j, (w, b) in enumerate(layers):
            out[f"{i}.{j}.linear.weight"], out[f"{i}.{j}.linear.bias"] = w, b
        if lm_heads:
            out[f"{i}.{len(layers)}.weight"] = lm_heads[i]
    return out


def save_heads(output: str, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file
    os.makedirs(output, exist_ok=True)
    with open(os.path.join(output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(output, "medusa_lm_head.safetensors"),
              metadata={"format": "pt"})
    return output


def random_heads(target_path: str, output: str, num_heads: int = 4, num_layers: int = 1, seed: int = 0,
                 original_lm_head: bool = False, std: float = 0.05) -> str:
    with open(os.path.join(target_path, "config.json")) as f:
        target = json.load(f)
    h, V = target["hidden_size"], target["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    blocks = [[(torch.randn(h, h, generator=g) * std, torch.randn(h, generator=g) * std) for _ in range(num_layers)]
              for _ in range(num_heads)]
    lm_heads = [] if original_lm_head else [torch.randn(V, h, generator=g) * std for _ in range(num_heads)]
    return save_heads(output, heads_config(target, num_heads, num_layers, original_lm_head),
                      published_names(blocks, lm_heads))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(random_heads(a.target, a.output, a.heads, a.layers, a.seed))


if __name__ == "__main__":
    main()
