"""Random-weight Hugging Face checkpoints of each supported architecture, and greedy
references from transformers itself."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

# initializer_range well above the default 0.02: small random models otherwise repeat one
# token forever, which would make exactness tests pass for the wrong reason.
COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              initializer_range=0.25, bos_token_id=1, eos_token_id=2)


def make_checkpoint(path: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    import transformers as tf
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    kw = {**COMMON, **overrides}
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif arch == "llama3":
        kw.setdefault("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        kw.setdefault("rope_theta", 500000.0)
        cfg, cls = tf.LlamaConfig(**kw), tf.LlamaForCausalLM
    elif arch == "mistral":
        kw.setdefault("sliding_window", 48)
        kw.setdefault("head_dim", 16)
        cfg, cls = tf.MistralConfig(**kw), tf.MistralForCausalLM
    elif arch == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
        cfg, cls = tf.Qwen2Config(**kw), tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 32)
        cfg, cls = tf.Qwen3Config(**kw), tf.Qwen3ForCausalLM
    elif arch == "gemma2":
        # Windows shorter than the prompts, soft-caps that bind (scores and logits of a
        # few units here), a query_pre_attn_scalar unlike head_dim.
        kw.update(head_dim=16, pad_token_id=0)
        kw.setdefault("sliding_window", 12)
        kw.setdefault("attn_logit_softcapping", 1.0)
        kw.setdefault("final_logit_softcapping", 1.0)
        kw.setdefault("query_pre_attn_scalar", 24)
        cfg, cls = tf.Gemma2Config(**kw), tf.Gemma2ForCausalLM
    elif arch == "gemma3":
        kw.update(head_dim=16, pad_token_id=0)
        kw.setdefault("num_hidden_layers", 3)
        kw.setdefault("layer_types", ["sliding_attention", "full_attention", "sliding_attention"][:kw["num_hidden_layers"]])
        kw.setdefault("sliding_window", 12)
        kw.setdefault("query_pre_attn_scalar", 24)
        kw.setdefault("rope_parameters", {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
        cfg, cls = tf.Gemma3TextConfig(**kw), tf.Gemma3ForCausalLM
    elif arch == "phi3":
        # LongRoPE with a 64-token original context: prompts and generations cross it.
        half = int((kw["hidden_size"] // kw["num_attention_heads"]) * kw.get("partial_rotary_factor", 1.0)) // 2
        kw.update(pad_token_id=0)
        kw.setdefault("original_max_position_embeddings", 64)
        kw.setdefault("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                       "long_factor": [2.0 + 0.5 * i for i in range(half)]})
        cfg, cls = tf.Phi3Config(**kw), tf.Phi3ForCausalLM
    elif arch == "granite":
        # Multipliers unlike 1 (Granite 3's are of these sizes), so that each one matters.
        kw.setdefault("embedding_multiplier", 6.0)
        kw.setdefault("attention_multiplier", 0.03)
        kw.setdefault("residual_multiplier", 0.3)
        kw.setdefault("logits_scaling", 4.0)
        cfg, cls = tf.GraniteConfig(**kw), tf.GraniteForCausalLM
    elif arch == "olmo2":
        cfg, cls = tf.Olmo2Config(**kw), tf.Olmo2ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if arch in ("gemma2", "gemma3"):
        # Gemma's norms start at zero (they compute x * (1 + w)): make them matter. The
        # sqrt(hidden) embedding scale would let the (tied) embedding drown every layer
        # and the model repeat its input token: smaller embeddings.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 1.0)
            model.model.embed_tokens.weight.mul_(0.2)
    if arch == "qwen2":
        # Random init leaves biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif kw.get("attention_bias") or kw.get("mlp_bias"):
        with torch.no_grad():
            for module in model.model.layers.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy output, one prompt at a time (no padding), EOS masked like
    min_tokens = max_tokens does in the engine."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            outs.append(ids[0, len(p):].tolist())
    return outs


def logprob_gaps(model, prompts: list[list[int]], outs, max_new_tokens: int) -> list[float]:
    """Asserts the engine's outputs (RequestOutputs with logprobs) carry `model`'s greedy
    tokens (transformers, one prompt at a time, EOS masked as min_tokens does); returns,
    per prompt, the largest |logprob - transformers' log-softmax| over its candidates."""
    gaps = []
    with torch.no_grad():
        for p, out in zip(prompts, outs):
            gen = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            assert out.token_ids == gen.sequences[0, len(p):].tolist()
            gaps.append(max(abs(lp.logprob - torch.log_softmax(step[0].float(), -1)[t].item())
                            for step, entry in zip(gen.logits, out.logprobs) for t, lp in entry.items()))
    return gaps


def check_against_model(model, prompts: list[list[int]], outs, max_new_tokens: int) -> float:
    """logprob_gaps' largest gap over every prompt."""
    return max(logprob_gaps(model, prompts, outs, max_new_tokens))


def hf_logprobs(path: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at each generated position: [len(output), V]."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1:len(prompt) + len(output) - 1], dim=-1)


def make_embedding_checkpoint(path: str, seed: int = 0, tokenizer_from: Optional[str] = None, **overrides) -> str:
    """A Qwen3-Embedding-style checkpoint: the bare Qwen3 decoder (no LM head, weights
    without the `model.` prefix) whose config names Qwen3ForCausalLM, as the released
    Qwen3-Embedding checkpoints are. tokenizer_from: a checkpoint whose tokenizer files
    to copy (and whose vocabulary size to take)."""
    import shutil

    import transformers as tf
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    kw = {**COMMON, "head_dim": 16, **overrides}
    if tokenizer_from is not None:
        tok = tf.AutoTokenizer.from_pretrained(tokenizer_from)
        kw["vocab_size"] = len(tok)
        tok.save_pretrained(path)
        for name in ("tokenizer_config.json",):     # as the source has it (its class name)
            shutil.copy(os.path.join(tokenizer_from, name), os.path.join(path, name))
    torch.manual_seed(seed)
    cfg = tf.Qwen3Config(**kw)
    tf.Qwen3Model(cfg).eval().save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    saved["architectures"] = ["Qwen3ForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)
    return path


def hf_last_token_embeddings(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' final hidden state (after the final norm) of each prompt's last
    token, L2-normalized: what Qwen3-Embedding's model card computes (one prompt at a time,
    no padding), fp32."""
    import torch.nn.functional as F
    from transformers import AutoModel
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [F.normalize(model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1) for p in prompts]
