"""The tensor-parallel benchmark runs end to end (tiny sizes) and prints its table."""

import re

from benchmarks.bench_tp import main


def test_bench_tp_prints_both_sizes_side_by_side(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    main(["--batches", "1", "2", "--steps", "2", "--repeats", "1", "--hidden", "64", "--layers", "1",
          "--heads", "4", "--kv-heads", "2", "--vocab", "320"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if re.match(r"\s+\d+ ", line)]
    assert [r[0] for r in rows] == ["1", "2"]
    for r in rows:
        one, two, ratio = float(r[1]), float(r[2]), float(r[3])
        assert one > 0 and two > 0 and abs(ratio - two / one) < 0.01 + 0.01 * ratio
