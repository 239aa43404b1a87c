"""A dense, plain-torch EAGLE-3 drafter written from the paper's description, to check the
engine's paged, chunked, in-step one against: the target's layer inputs come from
transformers (`output_hidden_states`: hidden_states[i] is what enters layer i)."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class DenseEagle3:
    def __init__(self, head_dir: str, target_dir: str) -> None:
        from transformers import AutoModelForCausalLM
        with open(os.path.join(head_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = {k: v.float() if v.is_floating_point() else v
                  for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items()}
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        if "embed_tokens.weight" not in self.w:
            self.w["embed_tokens.weight"] = self.target.model.embed_tokens.weight.detach()
        self.layers = self.cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        V, dv = self.cfg["vocab_size"], self.cfg["draft_vocab_size"]
        self.to_target = torch.arange(dv) + self.w["d2t"] if "d2t" in self.w else torch.arange(V)

    @torch.no_grad()
    def aux(self, tokens: list[int]) -> torch.Tensor:
        hs = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in sorted(self.layers)], dim=-1)

    @torch.no_grad()
    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(target-vocabulary logits [n, V], residual stream before the final norm [n, h])
        of the head over positions 0..n-1, causal."""
        c, w = self.cfg, self.w
        eps, n = c["rms_norm_eps"], len(tokens)
        nh, kvh = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // nh
        e = _rms(w["embed_tokens.weight"][tokens], w["midlayer.input_layernorm.weight"], eps)
        hn = _rms(hidden, w["midlayer.hidden_norm.weight"], eps)
        x = torch.cat([e, hn], -1)
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(n, nh, d).transpose(0, 1)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        f = torch.arange(n).float()[:, None] * inv[None]
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // kvh, 0), v.repeat_interleave(nh // kvh, 0)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        h = o.transpose(0, 1).reshape(n, nh * d) @ w["midlayer.self_attn.o_proj.weight"].T + hidden
        m = _rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
        m = (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
            @ w["midlayer.mlp.down_proj.weight"].T
        pre = m + h
        draft = _rms(pre, w["norm.weight"], eps) @ w["lm_head.weight"].T
        logits = torch.full((n, c["vocab_size"]), float("-inf"))
        logits[:, self.to_target] = draft
        return logits, pre

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        """Greedy proposals after `tokens` (the target has computed all but the last), and
        the top-1 / top-2 margin of each (near-ties are rounding's to break)."""
        hidden = self.aux(tokens[:-1]) @ self.w["fc.weight"].T
        ids = torch.tensor(tokens[1:])
        out, margins = [], []
        for _ in range(k):
            logits, pre = self._run(ids, hidden)
            top = logits[-1].topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1]])
            hidden = torch.cat([hidden, pre[-1:]])
        return out, margins


class DenseEagle1:
    """EAGLE-1 (arXiv 2401.15077): fc over [embedding, hidden], one decoder layer without
    its input norm, no final norm, the target's LM head; the target's final hidden state
    (after its norm) at the first position, the head's own output after it."""

    def __init__(self, head_dir: str, target_dir: str) -> None:
        from transformers import AutoModelForCausalLM
        with open(os.path.join(head_dir, "config.json")) as f:
            self.cfg = json.load(f)
        self.w = {k: v.float() for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items()}
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def _run(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        n = len(tokens)
        nh, kvh = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // nh
        x = torch.cat([self.target.model.embed_tokens.weight[tokens], hidden], -1) @ w["fc.weight"].T + w["fc.bias"]
        q = (x @ w["layers.0.self_attn.q_proj.weight"].T).view(n, nh, d).transpose(0, 1)
        k = (x @ w["layers.0.self_attn.k_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        v = (x @ w["layers.0.self_attn.v_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
        f = torch.arange(n).float()[:, None] * inv[None]
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // kvh, 0), v.repeat_interleave(nh // kvh, 0)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        h = o.transpose(0, 1).reshape(n, nh * d) @ w["layers.0.self_attn.o_proj.weight"].T + x
        m = _rms(h, w["layers.0.post_attention_layernorm.weight"], c["rms_norm_eps"])
        m = (F.silu(m @ w["layers.0.mlp.gate_proj.weight"].T) * (m @ w["layers.0.mlp.up_proj.weight"].T)) \
            @ w["layers.0.mlp.down_proj.weight"].T
        return m + h

    @torch.no_grad()
    def propose(self, tokens: list[int], k: int) -> tuple[list[int], list[float]]:
        hidden = self.target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states[-1][0]
        ids = torch.tensor(tokens[1:])
        out, margins = [], []
        for _ in range(k):
            pre = self._run(ids, hidden)
            top = self.target.lm_head(pre[-1]).topk(2)
            out.append(int(top.indices[0]))
            margins.append(float(top.values[0] - top.values[1]))
            ids = torch.cat([ids, top.indices[:1]])
            hidden = torch.cat([hidden, pre[-1:]])
        return out, margins
