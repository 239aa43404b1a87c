"""Compare built model-repository entries on a text, through the engine:

    python -m clients.quality --entry model_repository/llm-bf16 --entry model_repository/llm-int4 \
        [--text FILE] [--window 256] [--json out.json]

Each entry is loaded with its own settings (config.pbtxt: weights format, KV cache
dtype), scores the same token windows with prompt logprobs (builder/perplexity.py), and
the table gives its perplexity, the change against the first entry and how often its
most likely next token agrees with the first entry's. The default text is the held-out
split of the bundled corpus (builder/train_tiny.py), never trained on by the trained
reference models; --text: a UTF-8 file, paragraphs separated by blank lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from backend.build_manifest import read_manifest
from builder.perplexity import WINDOW, PerplexityReport, checkpoint_windows, entry_engine_args, perplexity_of


def read_paragraphs(path: Optional[str]) -> list[str]:
    if path is None:
        from builder.train_tiny import corpus_split
        return corpus_split()[1]
    with open(path, encoding="utf-8") as f:
        paras = [p.strip() for p in f.read().split("\n\n") if p.strip()]
    if not paras:
        raise SystemExit(f"error: --text '{path}' holds no text")
    return paras


def entry_format(entry: str) -> str:
    """'weights/kv cache' as the build recorded them, or '?' for an entry without manifest."""
    manifest = read_manifest(entry) or {}
    opts = manifest.get("options") or {}
    return f"{opts.get('weights', '?')}/{opts.get('kv_cache', '?')}"


def compare(entries: list[str], paragraphs: list[str], window: int = WINDOW) -> list[dict]:
    """One row per entry; the windows come from the first entry's tokenizer, and every
    entry must share its vocabulary."""
    checkpoints = [entry_engine_args(e)["model"] for e in entries]
    windows = checkpoint_windows(checkpoints[0], paragraphs, window)
    if not windows:
        raise SystemExit("error: the text gives no window of 2 tokens or more")
    vocab = {_vocab_size(c) for c in checkpoints}
    if len(vocab) > 1:
        raise SystemExit(f"error: the entries' vocabularies differ ({sorted(vocab)}): they cannot score one text")
    reports: list[PerplexityReport] = [perplexity_of(e, windows, entry=True) for e in entries]
    first = reports[0]
    return [{"entry": e, "format": entry_format(e), "tokens": r.tokens, "perplexity": r.perplexity,
             "delta_vs_first": r.perplexity / first.perplexity - 1, "top1_agreement_vs_first": r.top1_agreement(first)}
            for e, r in zip(entries, reports)]


def _vocab_size(checkpoint: str) -> int:
    with open(os.path.join(checkpoint, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)["vocab_size"]


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'entry':<40} {'format':<16} {'tokens':>7} {'perplexity':>11} {'vs first':>9} {'top-1 agree':>11}"]
    for r in rows:
        lines.append(f"{r['entry']:<40} {r['format']:<16} {r['tokens']:>7} {r['perplexity']:>11.3f} "
                     f"{r['delta_vs_first']:>+9.2%} {r['top1_agreement_vs_first']:>11.4f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clients.quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entry", action="append", required=True, help="a built entry folder; repeat (the first is "
                    "the reference)")
    ap.add_argument("--text", help="UTF-8 text file (default: the bundled corpus' held-out split)")
    ap.add_argument("--window", type=int, default=WINDOW, help="tokens per scored window (default %(default)s)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    if a.window < 2:
        ap.error("--window must be 2 or more")
    for e in a.entry:
        if not os.path.isfile(os.path.join(e, "config.pbtxt")):
            ap.error(f"--entry '{e}' is not a built entry (no config.pbtxt)")
    rows = compare(a.entry, read_paragraphs(a.text), a.window)
    print(format_rows(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
