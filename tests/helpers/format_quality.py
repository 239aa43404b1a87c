"""The check every weight format passes on the trained reference model
(builder/train_tiny.py): each format is built with `builder build`, the engine computes
the held-out perplexity of the built entry (the build's own report,
builder/perplexity.py), and the figures must keep their order and bounds.

Adding a format (docs/archive/status-notes.md, issue 33): append a FormatRow to FORMAT_ROWS with the
build options that make it and its bounds; `check_format_rows` then holds it to
`max_increase` over the bf16 row's perplexity, to staying at or above the rows named in
`above`, and, where its build reports one (builder/quality.py), to `min_top1` top-1
agreement with the source.

A format the builder cannot make (loaded from the wild only: bitsandbytes NF4/FP4,
block-wise FP8) gets a row with `write`: a function writing its checkpoint of the source
(the transcriptions the loader's tests use), whose perplexity the engine computes on the
builds' held-out texts, and whose top-1 agreement is the engine's most likely token
against the source's at each scored position (builder/perplexity.py).
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tests.helpers.bnb_checkpoints import write_bnb
from tests.helpers.quant_checkpoints import write_fp8

# bf16 is the reference: its weights are the source's exactly (the trained checkpoint
# holds bf16 values in fp32), only its activations round. The source (fp32 compute) must
# be within this of it.
REFERENCE = "bfloat16"
BF16_VS_SOURCE = 0.001
# "bf16 lowest" allows this much rounding luck: on the small trained model a format can
# land a little below bf16 (FP8 measured 0.22% below it: docs/quantization.md). The same
# slack applies to `above`.
NOISE = 0.005


@dataclass(frozen=True)
class FormatRow:
    name: str
    options: dict[str, Any]           # BuildOptions fields (weights, group_size, kv_cache, ...)
    max_increase: float               # perplexity / bf16's - 1 must not exceed this
    above: tuple[str, ...] = field(default=())   # rows this one must not beat (coarser formats)
    min_top1: Optional[float] = None  # top-1 agreement with the source (the build's, or the engine's), at least
    write: Optional[Callable[[str, str], str]] = None   # (source, out) -> its checkpoint, instead of a build


FORMAT_ROWS: list[FormatRow] = [
    FormatRow(REFERENCE, {"weights": "bfloat16"}, max_increase=0.0),    # held to BF16_VS_SOURCE
    FormatRow("fp8", {"weights": "fp8"}, max_increase=0.01, min_top1=0.93),
    FormatRow("int8", {"weights": "int8"}, max_increase=0.002, min_top1=0.99),
    FormatRow("int4", {"weights": "int4"}, max_increase=0.01, above=(REFERENCE, "fp8", "int8"), min_top1=0.9),
    # Measured 2026-11-25 on the builder's held-out texts: -0.07% (top-1 0.971) and +0.01%.
    FormatRow("fp8-dynamic", {"weights": "fp8", "activation_scheme": "dynamic"}, max_increase=0.01, min_top1=0.93),
    FormatRow("int8-kv", {"weights": "bfloat16", "kv_cache": "int8"}, max_increase=0.002),
    # Measured 2026-11-25 (docs/quantization.md), vs bf16: W8A8 -0.04% (top-1 0.982), and
    # on checkpoints the builder cannot make, NF4 -0.11% (engine top-1 0.947), FP4 +0.30%
    # (0.937), block FP8 +0.01% (0.974).
    FormatRow("w8a8", {"weights": "w8a8"}, max_increase=0.005, min_top1=0.96),
    FormatRow("nf4", {}, max_increase=0.01, above=(REFERENCE, "fp8", "int8", "w8a8"), min_top1=0.9,
              write=lambda src, out: write_bnb(src, out, "nf4")),
    FormatRow("fp4", {}, max_increase=0.015, above=(REFERENCE, "fp8", "int8", "w8a8"), min_top1=0.9,
              write=lambda src, out: write_bnb(src, out, "fp4")),
    FormatRow("fp8-block", {}, max_increase=0.01, min_top1=0.93, write=lambda src, out: write_fp8(src, out, (128, 128))),
]


def build_and_measure(checkpoint: str, out: str, row: FormatRow) -> dict[str, Any]:
    """Build `row`'s entry of `checkpoint` at `out` (or write its checkpoint there); its
    quality report: the build manifest's (the engine's perplexities under "perplexity"),
    or, for a written checkpoint, the same figures and the engine's top-1 agreement."""
    if row.write is not None:
        return _measure_written(checkpoint, row.write(checkpoint, out))
    from builder.build import BuildOptions, build
    build(BuildOptions.create(checkpoint=checkpoint, output=out, perplexity=True, num_kv_blocks=256,
                              **row.options), log=lambda *_: None, progress=False)
    with open(os.path.join(out, "build_manifest.json")) as f:
        return json.load(f)["quality"]


@functools.lru_cache(maxsize=4)
def _source_report(source: str, windows: tuple[tuple[int, ...], ...]):
    # Once per source and texts: every written row compares with the same figures.
    from builder.perplexity import perplexity_of
    return perplexity_of(source, [list(w) for w in windows])


def _measure_written(source: str, path: str) -> dict[str, Any]:
    """What build_perplexity reports, for a checkpoint the builder did not make: the
    engine on the source and on `path` (served as its config says), on the build's
    held-out texts."""
    from builder.fp8 import default_texts
    from builder.perplexity import checkpoint_windows, perplexity_of
    windows = checkpoint_windows(source, default_texts()[1])
    src, got = _source_report(source, tuple(map(tuple, windows))), perplexity_of(path, windows)
    return {"perplexity": {"held_out_tokens": src.tokens, "source_perplexity": src.perplexity,
                           "perplexity": got.perplexity}, "top1_agreement": got.top1_agreement(src)}


def check_format_rows(reports: dict[str, dict[str, Any]], rows: list[FormatRow] = FORMAT_ROWS) -> None:
    """AssertionError naming every row out of its bounds; `reports`: each row's build
    quality report, by name."""
    source = reports[REFERENCE]["perplexity"]["source_perplexity"]
    ppl = {name: r["perplexity"]["perplexity"] for name, r in reports.items()}
    ref = ppl[REFERENCE]
    problems = []
    if abs(ref / source - 1) > BF16_VS_SOURCE:
        problems.append(f"{REFERENCE} {ref:.4f} is more than {BF16_VS_SOURCE:.1%} from the source's {source:.4f}")
    for row in rows:
        got, top1 = ppl[row.name], reports[row.name].get("top1_agreement")
        if row.name == REFERENCE:
            continue
        if got == source:
            problems.append(f"{row.name} {got:.4f} is the source's perplexity exactly: the format was not applied")
        if got < ref * (1 - NOISE):
            problems.append(f"{row.name} {got:.4f} is below {REFERENCE} {ref:.4f}: bf16 must be lowest")
        if got / ref - 1 > row.max_increase:
            problems.append(f"{row.name} {got:.4f} is {got / ref - 1:+.2%} over {REFERENCE} {ref:.4f} "
                            f"(bound {row.max_increase:.1%})")
        for other in row.above:
            if got < ppl[other] * (1 - NOISE):
                problems.append(f"{row.name} {got:.4f} is below {other} {ppl[other]:.4f}")
        if row.min_top1 is not None and (top1 is None or top1 < row.min_top1):
            problems.append(f"{row.name} top-1 agreement {top1} is under {row.min_top1}")
    if problems:
        raise AssertionError("format quality check failed:\n  " + "\n  ".join(problems))
