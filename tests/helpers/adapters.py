"""PEFT LoRA adapters for the tiny test checkpoints, written by PEFT itself, and greedy
references from transformers + PEFT (`PeftModel`)."""

from __future__ import annotations

import os

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: str, path: str, rank: int = 8, alpha: float = 16, targets=ALL_TARGETS, seed: int = 0,
                 rslora: bool = False, std: float = 0.3) -> str:
    """A PEFT adapter of `base` with random A and B (PEFT starts B at zero, which would
    make the adapter a no-op and the tests pass for the wrong reason)."""
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        return path
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                                  lora_dropout=0.0, use_rslora=rslora, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(path)
    return path


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers (+ PEFT when an adapter is given) greedy output, one prompt at a time."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(input_ids=torch.tensor([p]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outs.append(ids[0, len(p):].tolist())
    return outs
