"""Issue 33: the trained reference model and the perplexity each weight format keeps on
it, computed by the engine on the built entries (tests/helpers/format_quality.py holds
the rows and bounds; other formats add theirs there)."""

import json

import pytest

from tests.conftest import assert_pool_free
from tests.helpers.format_quality import FORMAT_ROWS, REFERENCE, build_and_measure, check_format_rows


def test_the_training_script_reproduces_the_shipped_run(tmp_path):
    """The shipped weights come from builder/train_tiny.py with its seed: its first steps,
    rerun here, give the losses the shipped run logged (float noise only: the thread
    count and the CPU change the order of sums)."""
    from builder.train_tiny import SPECS, TRAINED_DIR, train
    for name in SPECS:
        with open(f"{TRAINED_DIR}/{name}.json") as f:
            shipped = json.load(f)
        assert shipped["spec"]["steps"] == shipped["steps_run"] == len(shipped["losses"])
        rerun = train(SPECS[name], str(tmp_path / name), steps=3, log=lambda *_: None)
        assert rerun["losses"] == pytest.approx(shipped["losses"][:3], rel=1e-4)


def test_format_perplexity_on_the_trained_model(trained_ckpt, tmp_path, monkeypatch):
    """The trained model's held-out perplexity as documented; bf16 lowest, FP8 (static,
    dynamic, block-wise), INT8, W8A8 and the INT8 KV cache within their stated tolerance,
    INT4 and bitsandbytes NF4/FP4 above those and within their bounds; quantizers whose
    scales are off by 2x (FP8 built, NF4 written) fail the check; and
    `python -m clients.quality` computes the same figures from the entries."""
    from backend import LLM
    from builder.perplexity import checkpoint_windows, engine_perplexity
    from builder.train_tiny import corpus_split
    from clients import quality
    # The figure docs/quantization.md and the README state: the whole held-out split, in
    # one engine with a pool smaller than the windows (they queue).
    llm = LLM(trained_ckpt, block_size=16, num_kv_blocks=128, max_model_len=257)
    held_out = engine_perplexity(llm, checkpoint_windows(trained_ckpt, corpus_split()[1]))
    assert held_out.tokens == 10435 and held_out.perplexity == pytest.approx(92.254, rel=1e-3)
    assert_pool_free(llm)
    reports = {row.name: build_and_measure(trained_ckpt, str(tmp_path / row.name), row) for row in FORMAT_ROWS}
    source = reports[REFERENCE]["perplexity"]["source_perplexity"]
    assert source < 150                           # far below the 4096-token vocabulary
    assert len({r["perplexity"]["source_perplexity"] for r in reports.values()}) == 1
    check_format_rows(reports)
    # The FP8 quantizer broken from here (not through any serving code): scales 2x.
    import builder.fp8
    good = builder.fp8.quantize_per_channel
    monkeypatch.setattr(builder.fp8, "quantize_per_channel", lambda w: (lambda q, s: (q, s * 2))(*good(w)))
    broken = build_and_measure(trained_ckpt, str(tmp_path / "broken"), FORMAT_ROWS[1])
    with pytest.raises(AssertionError, match=r"fp8 \S+ is \+\S+% over bfloat16(.|\n)*fp8 top-1 agreement"):
        check_format_rows({**reports, "fp8": broken})
    # A written NF4 checkpoint (no double quant) whose block absmax is 2x.
    import dataclasses

    import tests.helpers.bnb_checkpoints as bnb
    good4 = bnb.quantize_4bit
    monkeypatch.setattr(bnb, "quantize_4bit", lambda *a, **k: {
        key: t * 2 if key == ".absmax" else t for key, t in good4(*a, **k).items()})
    nf4 = dataclasses.replace(next(row for row in FORMAT_ROWS if row.name == "nf4"),
                              write=lambda src, out: bnb.write_bnb(src, out, "nf4", double_quant=False))
    broken = build_and_measure(trained_ckpt, str(tmp_path / "broken-nf4"), nf4)
    with pytest.raises(AssertionError, match=r"nf4 \S+ is \+\S+% over bfloat16(.|\n)*nf4 top-1 agreement"):
        check_format_rows({**reports, "nf4": broken})
    measured = {name: r["perplexity"]["perplexity"] for name, r in reports.items()}
    # clients.quality on the build's own held-out texts gives the build's figures.
    from builder.fp8 import default_texts
    text = tmp_path / "held.txt"
    text.write_text("\n\n".join(default_texts()[1]))
    assert quality.main(["--entry", str(tmp_path / REFERENCE), "--entry", str(tmp_path / "int4"),
                         "--text", str(text), "--json", str(tmp_path / "rows.json")]) == 0
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["perplexity"] for r in rows] == pytest.approx([measured[REFERENCE], measured["int4"]], rel=1e-9)
    assert [r["format"] for r in rows] == ["bfloat16/auto", "int4/auto"]
    assert rows[1]["delta_vs_first"] == pytest.approx(measured["int4"] / measured[REFERENCE] - 1, rel=1e-6)
    assert 0.5 < rows[1]["top1_agreement_vs_first"] < 1
