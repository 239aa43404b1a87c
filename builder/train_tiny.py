"""The trained reference models: the default architecture (TinySpec) and a smaller draft
sibling, trained on builder/data/corpus.txt with a held-out split, deterministically.

Why: the random-weight default model has flat logits, so a quantization report on it
cannot tell a good build from a broken one. These models have real next-token
distributions (held-out perplexity far below the 4096-token vocabulary), so a broken
quantization shows in perplexity and a draft's acceptance rate means something
(docs/quantization.md: the figures, and how far perplexity separates formats).

The repository ships the trained weights (builder/data/trained/*.safetensors, bf16) with
the log of the run that made them; `python -m builder tiny --trained` writes a checkpoint
from them in seconds, `--train` reruns this script (CPU, minutes). Determinism: a fixed
seed for the initialisation and for the batch order (its own generator),
torch.use_deterministic_algorithms, one thread (the order of a matmul's sums depends on
the thread count). The first steps' losses are kept in the log and a test reruns them.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from builder.tiny import CORPUS, TinySpec, build_tiny

TRAINED_DIR = os.path.join(os.path.dirname(__file__), "data", "trained")
# Every HELD_OUT_EVERY-th paragraph of the corpus is held out (never trained on), spread
# over the corpus so it covers every topic; the quality report's held-out texts
# (builder.fp8.default_texts) are a subset of it.
HELD_OUT_EVERY = 10
# The shipped runs logged the held-out perplexity every this many steps (it changes no
# weight: no dropout, no random draw).
EVAL_EVERY = 25


@dataclass(frozen=True)
class TrainSpec:
    """One trained model: its architecture and its training run."""
    name: str
    model: TinySpec
    steps: int = 400
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.1
    seed: int = 0


TARGET = TrainSpec("tiny-llama-trained", TinySpec(initializer_range=0.02))
# The draft sibling: 2 layers, half the width, the same tokenizer (speculative decoding
# needs the target's vocabulary).
DRAFT = TrainSpec("tiny-llama-trained-draft", TinySpec(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2,
                                                      initializer_range=0.02))
SPECS = {s.name: s for s in (TARGET, DRAFT)}


def corpus_split() -> tuple[list[str], list[str]]:
    """(training paragraphs, held-out paragraphs) of the bundled corpus."""
    with open(CORPUS, encoding="utf-8") as f:
        paras = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    held = set(range(HELD_OUT_EVERY - 1, len(paras), HELD_OUT_EVERY))
    from builder.fp8 import default_texts
    held |= {i for i, p in enumerate(paras) if p in set(default_texts()[1])}
    return [p for i, p in enumerate(paras) if i not in held], [p for i, p in enumerate(paras) if i in held]


def held_out_text() -> str:
    return "\n\n".join(corpus_split()[1])


def _token_stream(tokenizer, paras: list[str]):
    import torch
    ids: list[int] = []
    for p in paras:
        ids += [tokenizer.bos_token_id] + tokenizer.encode(p) + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def train(spec: TrainSpec, output: str, steps: Optional[int] = None, log: Callable[[str], None] = print,
          eval_every: int = 0) -> dict:
    """Train `spec` into the checkpoint folder `output` (fp32 weights); returns the run's
    log (losses per step, held-out perplexity). `steps` cuts the run short (tests);
    `eval_every` logs the held-out perplexity on the way."""
    return deterministically(_train, spec, output, spec.steps if steps is None else steps, log, eval_every)


def deterministically(fn: Callable, *args):
    """fn(*args) on one thread with deterministic algorithms (the order of a matmul's sums
    depends on the thread count); the caller's settings come back after."""
    import torch
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        return fn(*args)
    finally:                    # the caller's process (a test session) gets its settings back
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def cosine_lr(step: int, lr: float, warmup_steps: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    t = (step - warmup_steps) / max(1, steps - warmup_steps)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@dataclass
class FrozenTarget:
    """The trained reference model as a drafter's training reads it (transformers, fp32)."""
    path: str
    tokenizer: object
    model: object
    config: dict
    train_ids: object           # the training paragraphs' token stream
    held_ids: object            # the held-out paragraphs'


def frozen_target(folder: str) -> FrozenTarget:
    """The trained target written into `folder` and loaded, frozen, with the corpus split
    the target was trained on."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    build_trained(folder, TARGET.name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    train_paras, held_paras = corpus_split()
    return FrozenTarget(folder, tokenizer, model, config, _token_stream(tokenizer, train_paras),
                        _token_stream(tokenizer, held_paras))


def _train(spec: TrainSpec, output: str, steps: int, log: Callable[[str], None], eval_every: int) -> dict:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    build_tiny(output, spec.model)          # tokenizer, config and seeded initial weights
    tokenizer = AutoTokenizer.from_pretrained(output)
    model = LlamaForCausalLM.from_pretrained(output, dtype=torch.float32)
    model.train()
    train_paras, held_paras = corpus_split()
    data = _token_stream(tokenizer, train_paras)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))

    gen = torch.Generator().manual_seed(spec.seed)
    held = _token_stream(tokenizer, held_paras)
    losses, curve, t0 = [], {}, time.time()
    for step in range(steps):
        starts = torch.randint(0, len(data) - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[s:s + spec.seq_len + 1] for s in starts.tolist()])
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, spec.lr, spec.warmup_steps, spec.steps)
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone(), use_cache=False).loss
        # labels = inputs: transformers shifts them itself (predicts token t+1 from <= t).
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(round(loss.item(), 6))
        if eval_every and (step + 1) % eval_every == 0:
            model.eval()
            curve[step + 1] = round(perplexity_hf(model, held, spec.seq_len * 4), 3)
            model.train()
            log(f"{spec.name} step {step + 1}: held-out perplexity {curve[step + 1]}")
        if step % 50 == 0 or step == steps - 1:
            log(f"{spec.name} step {step}/{steps} loss {loss.item():.4f} ({time.time() - t0:.0f}s)")
    model.eval()
    # A run cut short (tests) skips the final held-out pass.
    ppl = perplexity_hf(model, held, spec.seq_len * 4) if steps == spec.steps else None
    model.save_pretrained(output)
    record = {"spec": asdict(spec), "steps_run": steps, "losses": losses, "held_out_tokens": len(held),
              "held_out_perplexity_fp32": ppl, "held_out_curve": curve,
              "seconds": round(time.time() - t0, 1), "torch": torch.__version__}
    with open(os.path.join(output, "train_log.json"), "w") as f:
        json.dump(record, f, indent=1)
    log(f"{spec.name}: {steps} steps, held-out perplexity {ppl}")
    return record


def perplexity_hf(model, ids, window: int) -> float:
    """exp(mean next-token NLL) over `ids`, in independent windows (transformers' forward)."""
    import torch
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, window):
            chunk = ids[s:s + window + 1]
            if len(chunk) < 2:
                break
            logits = model(input_ids=chunk[None, :-1], use_cache=False).logits[0].float()
            nll += torch.nn.functional.cross_entropy(logits, chunk[1:], reduction="sum").item()
            n += len(chunk) - 1
    return math.exp(nll / n)


def write_shipped(trained: str, name: str) -> None:
    """Store a trained checkpoint's weights as the shipped bf16 file and its run log."""
    with open(os.path.join(trained, "train_log.json")) as f:
        record = json.load(f)
    ship(os.path.join(trained, "model.safetensors"), name, record)


def ship(weights: str, name: str, record: dict) -> None:
    """A trained run's weights file as the shipped bf16 one (integer maps as they are),
    and its record, under builder/data/trained/ as `name`."""
    import torch
    from safetensors.torch import load_file, save_file
    os.makedirs(TRAINED_DIR, exist_ok=True)
    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in load_file(weights).items()}, os.path.join(TRAINED_DIR, f"{name}.safetensors"))
    with open(os.path.join(TRAINED_DIR, f"{name}.json"), "w") as f:
        json.dump(record, f, indent=1)


def unpack_shipped(name: str, output: str, save) -> str:
    """A drafter's shipped weights as a folder: save(output, its config, fp32 state), and
    its run's record (without the config) beside them as train_log.json."""
    state, record = shipped(name)
    save(output, record["config"], state)
    with open(os.path.join(output, "train_log.json"), "w") as f:
        json.dump({k: v for k, v in record.items() if k != "config"}, f, indent=1)
    return output


def shipped(name: str) -> tuple[dict, dict]:
    """(the shipped weights of `name` in fp32, integer maps as they are; its run's record)."""
    from safetensors.torch import load_file
    weights = os.path.join(TRAINED_DIR, f"{name}.safetensors")
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"no shipped weights for '{name}' at {weights}")
    with open(os.path.join(TRAINED_DIR, f"{name}.json")) as f:
        record = json.load(f)
    return {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(weights).items()}, record


def build_trained(output: str, name: str = TARGET.name) -> str:
    """A float32 checkpoint folder from the shipped bf16 weights (the values are bf16's, so
    a bfloat16 build of it is lossless): tokenizer and config as build_tiny writes them."""
    from safetensors.torch import save_file
    state, record = shipped(name)
    build_tiny(output, SPECS[name].model)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(output, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(output, "train_log.json"), "w") as f:
        json.dump(record, f, indent=1)
    return output
