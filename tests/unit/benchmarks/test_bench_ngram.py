"""benchmarks.bench_ngram: both paths run, agree, and are reported per context."""

import pytest

from backend.engine.spec_decode import ngram_index
from benchmarks import bench_ngram


def test_the_index_and_the_scan_side_by_side(monkeypatch, capsys):
    monkeypatch.setattr(ngram_index, "SCAN_MAX_TOKENS", 100)     # (the index answers from 100 tokens)
    monkeypatch.setattr(ngram_index, "MIN_PENDING", 4)
    results = bench_ngram.main(["--num-seqs", "3", "--contexts", "40", "400", "--steps", "12"])
    assert [r["context"] for r in results] == [40, 400]
    assert all(r["index_ms"] > 0 and r["scan_ms"] > 0 for r in results)
    out = capsys.readouterr().out
    assert "index ms/step" in out and len(out.strip().splitlines()) == 4


def test_a_disagreement_is_an_error(monkeypatch):
    monkeypatch.setattr(ngram_index, "SCAN_MAX_TOKENS", 0)
    monkeypatch.setattr(ngram_index.NgramIndex, "lookup", lambda self, tokens, k: [-1])
    with pytest.raises(AssertionError, match="proposed differently"):
        bench_ngram.run(2, 50, 3, 2, 5, 4)
