"""Held-out perplexity computed by the engine itself: each window of tokens is a prompt
with `prompt_logprobs` (vLLM's: the logprob of each actual prompt token given those
before it, from the batched step, and here the most likely token's too), so what is
measured is what the entry serves: its quantized weights, kernels and KV cache format.

Used by `builder build` (source vs the built entry, in the manifest's quality report)
and by `python -m clients.quality` (any built entries, on any text).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

# Windows as the quality report (builder.quality.load_source) truncates its texts.
WINDOW = 256


@dataclass(frozen=True)
class PerplexityReport:
    tokens: int             # scored tokens (every window's tokens after its first)
    nll: float              # their summed negative log-likelihood (nats)
    top1_ids: tuple[int, ...] = ()      # the most likely token at each scored position

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def top1_agreement(self, other: "PerplexityReport") -> float:
        """Share of positions where both models' most likely token is the same."""
        if len(self.top1_ids) != len(other.top1_ids):
            raise ValueError("reports of different texts")
        return sum(a == b for a, b in zip(self.top1_ids, other.top1_ids)) / max(1, len(self.top1_ids))


def text_windows(encode: Callable[[str], list[int]], bos_token_id: Optional[int], texts: Sequence[str],
                 window: int = WINDOW) -> list[list[int]]:
    """Each text as BOS + its tokens (as the trained models saw paragraphs in training),
    cut into windows of at most `window` tokens; windows shorter than 2 are dropped."""
    out = []
    for text in texts:
        ids = ([] if bos_token_id is None else [bos_token_id]) + list(encode(text))
        out += [ids[s:s + window] for s in range(0, len(ids), window) if len(ids[s:s + window]) > 1]
    return out


def checkpoint_windows(checkpoint: str, texts: Sequence[str], window: int = WINDOW) -> list[list[int]]:
    """text_windows with a checkpoint's tokenizer and BOS (builder.quality.text_encoder),
    the window within the model's context (one position left for the generated token)."""
    import json

    from builder.quality import text_encoder
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    window = min(window, cfg.get("max_position_embeddings", window + 1) - 1)
    return text_windows(text_encoder(checkpoint, cfg["vocab_size"]), cfg.get("bos_token_id"), texts, window)


def engine_perplexity(llm, windows: list[list[int]]) -> PerplexityReport:
    """Perplexity of `windows` (token-id prompts) under an engine (backend.LLM)."""
    from backend import SamplingParams
    # prompt_logprobs=1: the actual token's logprob and the most likely token's.
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, ignore_eos=True)
    nll, n, top1 = 0.0, 0, []
    for window, out in zip(windows, llm.generate(windows, params)):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:]):
            nll -= entry[token].logprob
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            n += 1
    return PerplexityReport(tokens=n, nll=nll, top1_ids=tuple(top1))


def entry_engine_args(entry: str) -> dict[str, Any]:
    """The engine arguments a model-repository entry serves with (its config.pbtxt
    parameters, paths resolved as the Triton adapter resolves them), server-only keys out."""
    from backend.triton_server.serving_config import load_settings
    pbtxt = os.path.join(entry, "config.pbtxt")
    if not os.path.isfile(pbtxt):
        raise FileNotFoundError(f"'{entry}' is not a built entry: no config.pbtxt (build one with "
                                "`python -m builder build`)")
    with open(pbtxt, encoding="utf-8") as f:
        params = dict(re.findall(r'key: "([^"]+)" value: \{ string_value: "([^"]*)" \}', f.read()))
    args, _ = load_settings(params, entry)
    return args.model_dump(exclude_defaults=True)


def perplexity_of(model: str, windows: list[list[int]], entry: bool = False) -> PerplexityReport:
    """Engine perplexity of a checkpoint folder, or of a built entry (`entry=True`, with
    its own settings), on token windows."""
    from backend import LLM
    args = entry_engine_args(model) if entry else {"model": model}
    # Every window is scored once: no cache hits wanted (prompt logprobs bypass them anyway).
    args.update(enable_prefix_caching=False, max_model_len=max(map(len, windows)) + 1)
    # The format is measured, not the serving layout: one rank, no draft (scoring a
    # prompt proposes nothing), no adapters (the base model is scored).
    for key in ("speculative_config", "lora_modules", "tensor_parallel_size"):
        args.pop(key, None)
    llm = LLM(**args)
    try:
        return engine_perplexity(llm, windows)
    finally:
        llm.close()


def build_perplexity(source: str, entry: str, texts: Sequence[str]) -> dict[str, Any]:
    """The build's perplexity report: the source checkpoint and the built entry, both
    through the engine, on the held-out texts (the quality report's)."""
    windows = checkpoint_windows(source, texts)
    src, built = perplexity_of(source, windows), perplexity_of(entry, windows, entry=True)
    return {"held_out_tokens": src.tokens, "source_perplexity": src.perplexity, "perplexity": built.perplexity}
