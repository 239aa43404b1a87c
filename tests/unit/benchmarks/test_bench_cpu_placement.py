"""benchmarks/bench_cpu_placement.py end to end at a small size (its figures come from
benchmark runs: docs/archive/benchmarks.md section 35)."""

import re

import pytest

from backend.engine.runner import cpu_shards
from benchmarks import bench_cpu_placement
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.threads import on_fresh_thread


def test_times_each_placement(ckpt_dir, capsys, monkeypatch):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    monkeypatch.setattr(cpu_shards, "MAX_SHARD_SHARE", cpu_shards.MAX_SHARD_SHARE)     # (restored after)
    monkeypatch.setattr(cpu_shards, "CONTENDED_EFFICIENCY", cpu_shards.CONTENDED_EFFICIENCY)
    try:
        on_fresh_thread(lambda: bench_cpu_placement.main(
            ["--checkpoint", path, "--repeats", "1", "--prompt-lens", "24", "--rows", "4", "--contexts", "16"]))
    except SystemExit as e:             # (a machine where the forward is not split: one core)
        pytest.skip(str(e))
    out = capsys.readouterr().out
    assert re.search(r"prompt +24: whole, 2 threads +[\d.]+ ms, split +[\d.]+ ms", out)
    assert re.search(r"4 rows x +16: split +[\d.]+ ms, whole, one thread +[\d.]+ ms", out)
