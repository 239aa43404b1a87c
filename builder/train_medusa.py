"""Train Medusa heads for the trained reference model (builder/train_tiny.py) on its
corpus, deterministically; the repository ships the result
(builder/data/trained/tiny-llama-trained-medusa.*) and `python -m builder tiny --trained
--medusa` writes it as a heads checkpoint.

    python -m builder.train_medusa --output DIR [--steps N] [--ship]

Medusa-1 (arXiv 2401.10774) with self-distillation: the target stays frozen; head i
(one residual block on the target's final hidden state at position p, then the target's
own LM head: `original_lm_head`) learns the target's distribution at position p + 1 + i,
i.e. of token p + 2 + i. The blocks start at zero (each head starts as the target's next
token guess), as the Medusa authors initialise them. Determinism as in train_tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from builder.train_tiny import cosine_lr, deterministically, frozen_target, ship, unpack_shipped

NAME = "tiny-llama-trained-medusa"


@dataclass(frozen=True)
class MedusaSpec:
    num_heads: int = 4
    num_layers: int = 1
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    seed: int = 0


SPEC = MedusaSpec()


def train(output: str, spec: MedusaSpec = SPEC, steps: Optional[int] = None, log: Callable[[str], None] = print
          ) -> dict:
    return deterministically(_train, output, spec, spec.steps if steps is None else steps, log)


def _heads_logits(blocks, lm_head, hidden, i: int):
    import torch.nn.functional as F
    x = hidden
    for w, b in blocks[i]:
        x = x + F.silu(x @ w.T + b)
    return x @ lm_head.T


def _train(output: str, spec: MedusaSpec, steps: int, log: Callable[[str], None]) -> dict:
    import torch
    import torch.nn.functional as F
    from builder.medusa_heads import heads_config, published_names, save_heads
    frozen = frozen_target(os.path.join(output, "_target"))
    target, tcfg, data, held = frozen.model, frozen.config, frozen.train_ids, frozen.held_ids
    h = tcfg["hidden_size"]
    blocks = [[(torch.zeros(h, h, requires_grad=True), torch.zeros(h, requires_grad=True))
               for _ in range(spec.num_layers)] for _ in range(spec.num_heads)]
    params = [t for layers in blocks for pair in layers for t in pair]
    lm_head = target.lm_head.weight.detach()
    opt = torch.optim.AdamW(params, lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def features(batch):
        with torch.no_grad():
            out = target(input_ids=batch, output_hidden_states=True, use_cache=False)
        return out.hidden_states[-1], out.logits        # (after the final norm)

    def loss_and_agreement(hidden, logits):
        total, agree = 0.0, []
        for i in range(spec.num_heads):
            # Position p's head i: the target's distribution at p + 1 + i.
            n = hidden.shape[1] - 1 - i
            guess = _heads_logits(blocks, lm_head, hidden[:, :n], i)
            teacher = F.softmax(logits[:, 1 + i:1 + i + n], dim=-1)
            total = total + -(teacher * F.log_softmax(guess, dim=-1)).sum(-1).mean()
            agree.append(round((guess.argmax(-1) == teacher.argmax(-1)).float().mean().item(), 4))
        return total, agree

    gen = torch.Generator().manual_seed(spec.seed)
    losses, t0 = [], time.time()
    for step in range(steps):
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[s:s + spec.seq_len + 1] for s in starts.tolist()])
        hidden, logits = features(batch)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, spec.lr, spec.warmup_steps, spec.steps)
        loss, agree = loss_and_agreement(hidden, logits)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(round(loss.item(), 6))
        if step % 50 == 0 or step == steps - 1:
            log(f"{NAME} step {step}/{steps} loss {loss.item():.4f} top-1 agreement by head {agree} "
                f"({time.time() - t0:.0f}s)")
    held_agree = None
    if steps == spec.steps:
        n = (len(held) - 1) // (spec.seq_len + 1)
        with torch.no_grad():
            held_agree = loss_and_agreement(*features(held[:n * (spec.seq_len + 1)].view(n, spec.seq_len + 1)))[1]
    cfg = heads_config(tcfg, spec.num_heads, spec.num_layers, original_lm_head=True)
    save_heads(output, cfg, published_names([[(w.detach(), b.detach()) for w, b in layers] for layers in blocks], []))
    record = {"spec": asdict(spec), "steps_run": steps, "losses": losses,
              "held_out_top1_agreement_by_head": held_agree, "seconds": round(time.time() - t0, 1),
              "torch": torch.__version__, "config": cfg}
    with open(os.path.join(output, "train_log.json"), "w") as f:
        json.dump(record, f, indent=1)
    log(f"{NAME}: {steps} steps, held-out top-1 agreement by head {held_agree}")
    return record


def write_shipped(trained: str) -> None:
    """Store trained heads as the shipped bf16 weights and their log (with their config)."""
    with open(os.path.join(trained, "train_log.json")) as f:
        record = json.load(f)
    ship(os.path.join(trained, "medusa_lm_head.safetensors"), NAME, record)


def build_heads(output: str) -> str:
    """The shipped heads as a checkpoint folder (fp32 values of the bf16 weights)."""
    from builder.medusa_heads import save_heads
    return unpack_shipped(NAME, output, save_heads)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--ship", action="store_true")
    a = ap.parse_args(argv)
    train(a.output, steps=a.steps)
    if a.ship:
        write_shipped(a.output)


if __name__ == "__main__":
    main()
