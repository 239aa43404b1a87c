"""benchmarks/bench_kv_offload.py end to end at a small size (its figures come from
benchmark runs: docs/archive/benchmarks.md), and that its TTFT is the first token's."""

import json
import time

from backend import LLM
from benchmarks import bench_kv_offload
from tests.helpers.checkpoints import make_checkpoint


def test_runs_both_engines_on_one_conversation(ckpt_dir, tmp_path, capsys):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    out = tmp_path / "k.json"
    bench_kv_offload.main(["--checkpoint", path, "--history", "160", "--turns", "3", "--repeats", "1",
                           "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["replies_equal"] and report["hit_blocks"] > 0 and report["saved_blocks"] > 0
    assert [t["turn"] for t in report["turns"]] == [1, 2, 3]
    assert all(t["ttft_with_s"] > 0 and t["ttft_without_s"] > 0 for t in report["turns"])
    assert "turn  history" in capsys.readouterr().out


def test_ttft_is_the_first_tokens_not_the_last(ckpt_dir, monkeypatch):
    """(RequestOutput.token_ids is filled in on the final output only: timing it gave the
    whole request's latency.)"""
    llm = LLM(make_checkpoint(str(ckpt_dir / "llama"), "llama"), block_size=16, num_kv_blocks=64)
    monkeypatch.setattr(bench_kv_offload, "REPLY", 64)
    start = time.perf_counter()
    first, tokens = bench_kv_offload.ttft(llm, list(range(3, 40)))
    whole = time.perf_counter() - start
    assert len(tokens) == 64 and first < whole / 4, (first, whole)
