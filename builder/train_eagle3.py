"""Train an EAGLE-3 head for the trained reference model (builder/train_tiny.py), on its
corpus, deterministically; the repository ships the result
(builder/data/trained/tiny-llama-trained-eagle3.*) and `python -m builder tiny --trained
--eagle3` writes it as a head checkpoint.

    python -m builder.train_eagle3 --output DIR [--steps N] [--ship]

What is trained (arXiv 2503.01840): the head reads token p + 1 and the target's residual
stream entering layers 1, 2 and 3 at position p (`fc` fuses them) and predicts the
target's distribution of token p + 2 over the draft vocabulary (the corpus's most
frequent ids, mapped to the target's by d2t). "Training-time test": the same loss at
depths 1 and 2, where the head continues from its own output at the position before,
with the attention pattern drafting has: at depth s, position q sees the target-fed
entries up to q - s and its own depth-j entries at q - s + j. The target and its
embedding stay frozen; the LM head starts from the target's rows of the draft ids.
Determinism as in train_tiny: seeds, one thread, deterministic algorithms.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from builder.train_tiny import cosine_lr, deterministically, frozen_target, ship, unpack_shipped

NAME = "tiny-llama-trained-eagle3"


@dataclass(frozen=True)
class HeadSpec:
    aux_layers: tuple[int, ...] = (1, 2, 3)
    draft_vocab: int = 2048
    depths: int = 3                 # training-time test: the head's own continuation, twice
    depth_decay: float = 0.8        # the loss weight of depth s: decay ** s
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    init_std: float = 0.02
    seed: int = 0


SPEC = HeadSpec()


def _rms(x, w, eps):
    import torch
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    import torch
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class _TrainHead:
    """The head as one differentiable function of its weights (published names), over
    [B, T] positions at every depth of the training-time test."""

    def __init__(self, cfg: dict, params: dict, embed) -> None:
        import torch
        self.cfg, self.p, self.embed = cfg, params, embed
        nh, h = cfg["num_attention_heads"], cfg["hidden_size"]
        d = h // nh
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        f = torch.arange(4096).float()[:, None] * inv[None]
        self.cos, self.sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()

    def depth(self, tokens, hidden, keys: list, values: list, s: int):
        """Depth s over tokens [B, T] with hidden inputs [B, T, h]: (draft logits,
        residual stream before the final norm); appends its K/V to keys/values."""
        import torch
        import torch.nn.functional as F
        c, p = self.cfg, self.p
        eps, (B, T) = c["rms_norm_eps"], tokens.shape
        nh, kvh = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // nh
        x = torch.cat([_rms(self.embed[tokens], p["midlayer.input_layernorm.weight"], eps),
                       _rms(hidden, p["midlayer.hidden_norm.weight"], eps)], -1)
        q = (x @ p["midlayer.self_attn.q_proj.weight"].T).view(B, T, nh, d).transpose(1, 2)
        k = (x @ p["midlayer.self_attn.k_proj.weight"].T).view(B, T, kvh, d).transpose(1, 2)
        v = (x @ p["midlayer.self_attn.v_proj.weight"].T).view(B, T, kvh, d).transpose(1, 2)
        cos, sin = self.cos[:T], self.sin[:T]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        keys.append(k.repeat_interleave(nh // kvh, 1))
        values.append(v.repeat_interleave(nh // kvh, 1))
        pos = torch.arange(T)
        # Depth 0's entries up to q - s, depth j's at q - s + j (what drafting sees).
        allowed = [pos[None, :] <= pos[:, None] - s] + [pos[None, :] == pos[:, None] - s + j for j in range(1, s + 1)]
        mask = torch.cat(allowed, dim=1)
        o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)
        h = o.transpose(1, 2).reshape(B, T, nh * d) @ p["midlayer.self_attn.o_proj.weight"].T + hidden
        m = _rms(h, p["midlayer.post_attention_layernorm.weight"], eps)
        m = (F.silu(m @ p["midlayer.mlp.gate_proj.weight"].T) * (m @ p["midlayer.mlp.up_proj.weight"].T)) \
            @ p["midlayer.mlp.down_proj.weight"].T
        pre = m + h
        return _rms(pre, p["norm.weight"], eps) @ p["lm_head.weight"].T, pre

    def loss(self, tokens, aux, target_logits, draft_ids, spec: HeadSpec):
        """Distillation loss over every depth, and depth 0's top-1 agreement with the
        target. tokens [B, T + 1]; aux [B, T + 1, 3 h]; target_logits [B, T + 1, V]."""
        import torch
        import torch.nn.functional as F
        # Position q (0..T-1) reads token q + 1 and predicts the target's distribution at q + 1.
        inputs, teacher = tokens[:, 1:], F.softmax(target_logits[:, 1:, draft_ids], dim=-1)
        hidden = aux[:, :-1] @ self.p["fc.weight"].T
        keys, values, total, agree = [], [], 0.0, None
        for s in range(spec.depths):
            logits, pre = self.depth(inputs, hidden, keys, values, s)
            ce = -(teacher * F.log_softmax(logits, dim=-1)).sum(-1)[:, s:]     # (q < s has no real input)
            total = total + spec.depth_decay ** s * ce.mean()
            if s == 0:
                agree = (logits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
            hidden = torch.cat([torch.zeros_like(pre[:, :1]), pre[:, :-1]], dim=1)   # the position before's output
        return total, agree


def _draft_vocab(ids, vocab_size: int, n: int):
    """The n most frequent ids of the training stream (ties: lower id), sorted."""
    import torch
    counts = torch.bincount(ids, minlength=vocab_size).float()
    counts -= torch.arange(vocab_size).float() * 1e-9
    return torch.sort(torch.topk(counts, n).indices).values


def train(output: str, spec: HeadSpec = SPEC, steps: Optional[int] = None, log: Callable[[str], None] = print) -> dict:
    """Train the head into `output` (a head checkpoint folder, fp32); returns the run's log."""
    return deterministically(_train, output, spec, spec.steps if steps is None else steps, log)


def _train(output: str, spec: HeadSpec, steps: int, log: Callable[[str], None]) -> dict:
    import torch
    from builder.eagle_heads import head_config, save_head, vocab_maps
    frozen = frozen_target(os.path.join(output, "_target"))
    target, tcfg, data, held = frozen.model, frozen.config, frozen.train_ids, frozen.held_ids
    V = tcfg["vocab_size"]
    draft_ids = _draft_vocab(data, V, spec.draft_vocab)
    cfg = head_config(tcfg, spec.draft_vocab, list(spec.aux_layers))
    g = torch.Generator().manual_seed(spec.seed)
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    d, kvh, inter = h // nh, cfg["num_key_value_heads"], cfg["intermediate_size"]

    def w(*shape):
        return (torch.randn(*shape, generator=g) * spec.init_std).requires_grad_(True)
    params = {
        "fc.weight": w(h, 3 * tcfg["hidden_size"]), "midlayer.self_attn.q_proj.weight": w(nh * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(kvh * d, 2 * h), "midlayer.self_attn.v_proj.weight": w(kvh * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, nh * d), "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h), "midlayer.mlp.down_proj.weight": w(h, inter),
        "lm_head.weight": target.lm_head.weight[draft_ids].detach().clone().requires_grad_(True),
    }
    for n in ("midlayer.hidden_norm", "midlayer.input_layernorm", "midlayer.post_attention_layernorm", "norm"):
        params[f"{n}.weight"] = torch.ones(h, requires_grad=True)
    head = _TrainHead(cfg, params, target.model.embed_tokens.weight.detach())
    decay = [p for n, p in params.items() if p.dim() >= 2]
    rest = [p for n, p in params.items() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))

    def features(batch):
        with torch.no_grad():
            out = target(input_ids=batch, output_hidden_states=True, use_cache=False)
        return torch.cat([out.hidden_states[i] for i in spec.aux_layers], -1), out.logits

    data_gen = torch.Generator().manual_seed(spec.seed + 1)
    losses, agreement, t0 = [], [], time.time()
    for step in range(steps):
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=data_gen)
        batch = torch.stack([data[s:s + spec.seq_len + 1] for s in starts.tolist()])
        aux, logits = features(batch)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, spec.lr, spec.warmup_steps, spec.steps)
        loss, agree = head.loss(batch, aux, logits, draft_ids, spec)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        opt.step()
        losses.append(round(loss.item(), 6))
        agreement.append(round(agree, 4))
        if step % 50 == 0 or step == steps - 1:
            log(f"{NAME} step {step}/{steps} loss {loss.item():.4f} top-1 agreement {agree:.3f} "
                f"({time.time() - t0:.0f}s)")
    held_agree = _held_out_agreement(head, held, features, draft_ids, spec) if steps == spec.steps else None
    d2t, t2d = vocab_maps(draft_ids, V)
    tensors = {k: v.detach() for k, v in params.items()}
    tensors.update(d2t=d2t, t2d=t2d)
    save_head(output, cfg, tensors, frozen.path)
    record = {"spec": asdict(spec), "steps_run": steps, "losses": losses, "top1_agreement": agreement,
              "held_out_top1_agreement_by_depth": held_agree, "seconds": round(time.time() - t0, 1),
              "torch": torch.__version__}
    with open(os.path.join(output, "train_log.json"), "w") as f:
        json.dump(record, f, indent=1)
    log(f"{NAME}: {steps} steps, held-out top-1 agreement by depth {held_agree}")
    return record


def _held_out_agreement(head: _TrainHead, held, features, draft_ids, spec: HeadSpec) -> list[float]:
    """Per depth: how often the head's top-1 is the target's on held-out text."""
    import torch
    n = (len(held) - 1) // (spec.seq_len + 1)
    batch = held[:n * (spec.seq_len + 1)].view(n, spec.seq_len + 1)
    aux, logits = features(batch)
    with torch.no_grad():
        inputs, want = batch[:, 1:], logits[:, 1:, draft_ids].argmax(-1)
        hidden = aux[:, :-1] @ head.p["fc.weight"].T
        keys, values, out = [], [], []
        for s in range(spec.depths):
            got, pre = head.depth(inputs, hidden, keys, values, s)
            out.append(round((got.argmax(-1) == want)[:, s:].float().mean().item(), 4))
            hidden = torch.cat([torch.zeros_like(pre[:, :1]), pre[:, :-1]], dim=1)
    return out


def write_shipped(trained: str) -> None:
    """Store a trained head as the shipped bf16 weights (d2t/t2d as they are) and its log."""
    with open(os.path.join(trained, "train_log.json")) as f:
        record = json.load(f)
    with open(os.path.join(trained, "config.json")) as f:
        record["config"] = json.load(f)
    ship(os.path.join(trained, "model.safetensors"), NAME, record)


def build_head(output: str) -> str:
    """The shipped head as a checkpoint folder (fp32 values of the bf16 weights)."""
    from builder.eagle_heads import save_head
    return unpack_shipped(NAME, output, save_head)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--steps", type=int, help="cut the run short (the shipped run: the spec's steps)")
    ap.add_argument("--ship", action="store_true", help="store the result as the shipped weights")
    a = ap.parse_args(argv)
    train(a.output, steps=a.steps)
    if a.ship:
        write_shipped(a.output)


if __name__ == "__main__":
    main()
