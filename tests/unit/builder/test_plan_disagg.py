"""builder/plan_disagg.py and `builder plan --disaggregation`: the roofline figures from
the model's own counts, each verdict's condition, and clear errors."""

import json

import pytest

from builder.__main__ import main
from builder.plan_disagg import GPU_SPECS, estimate


def test_the_figures_follow_the_roofline():
    flops, bandwidth = GPU_SPECS["H100-80GB"]
    e = estimate(active_params=8_000_000_000, weight_bytes=16_000_000_000, kv_bytes_per_token=131072,
                 gpu="H100-80GB", input_tokens=4096, requests_per_s=1.0, link_gb_s=50.0,
                 max_num_batched_tokens=2048, mfu=0.5)
    assert e.prefill_s == pytest.approx(2 * 8e9 * 4096 / (flops * 0.5))
    assert e.chunk_stall_s == pytest.approx(e.prefill_s / 2)          # a 2,048-token chunk of 4,096
    assert e.decode_step_floor_s == pytest.approx(16e9 / bandwidth)
    assert e.prefill_share == pytest.approx(e.prefill_s)              # one request a second
    assert e.kv_bytes == 131072 * 4096 and e.copy_s == pytest.approx(e.kv_bytes / 50e9)


@pytest.mark.parametrize("rate, link, pays, words", [
    (0.1, 50.0, False, "chunked prefill"),      # prefills are a small share: no
    (2.0, 50.0, True, "stalls decoding"),       # a large share, a cheap copy: yes
    (2.0, 0.5, False, "a faster link"),         # a large share, but the copy costs too much
    (20.0, 50.0, True, "prefill workers"),      # prefills alone exceed a replica
])
def test_each_verdict(rate, link, pays, words):
    e = estimate(8_000_000_000, 16_000_000_000, 131072, "H100-80GB", 4096, rate, link)
    assert e.pays is pays and words in e.why


def test_the_command_prints_and_writes_it(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "H200-141GB", "--tp", "1", "--weights", "bf16",
                 "--requests-per-day", "500000", "--input-tokens", "8000", "--output-tokens", "200",
                 "--disaggregation", "--json", str(out)]) == 0
    assert "disaggregation, 8,000-token prompts" in capsys.readouterr().out
    written = json.loads(out.read_text())["disaggregation"]
    assert written["pays"] is True and written["kv_bytes"] == 8000 * 131072


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "custom", "--gpu-memory-gb", "80", "--gpu-price-per-hour", "1", "--requests-per-day", "1",
      "--input-tokens", "10"], "no compute and bandwidth figures"),
    (["--input-tokens", "100"], "--requests-per-day"),
])
def test_clear_errors(argv, words, capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--tp", "1", "--disaggregation", *argv]) != 0
    assert words in capsys.readouterr().err
