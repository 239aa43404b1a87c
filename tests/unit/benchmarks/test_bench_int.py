"""The INT benchmark's GPTQ writer makes a checkpoint the engine reads as GPTQ, whose
weights are the round-to-nearest of the source within half a step; the benchmark runs
end to end on CPU (tiny sizes; its figures mean something on a GPU only)."""

import json
import os

import torch
from safetensors.torch import load_file

from backend.models import int_formats
from benchmarks.bench_int import main, write_gptq_rtn
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.int_checkpoints import gptq_reference


def test_gptq_writer_round_trips(ckpt_dir, tmp_path):
    src = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    dst = write_gptq_rtn(src, str(tmp_path / "gptq"), 4, 32)
    state, source = load_file(os.path.join(dst, "model.safetensors")), load_file(os.path.join(src, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj"
    w = gptq_reference(state[f"{name}.qweight"], state[f"{name}.qzeros"], state[f"{name}.scales"],
                       state[f"{name}.g_idx"], 4)
    step = state[f"{name}.scales"].float().repeat_interleave(32, 0).t()
    assert ((w - source[f"{name}.weight"].float()).abs() <= step / 2 + 1e-6).all()
    scheme = int_formats.scheme_of(json.load(open(os.path.join(dst, "config.json")))["quantization_config"])
    got = int_formats.dequantize(int_formats.read_projection(state, name, scheme), 4)
    assert torch.equal(got, w)


def test_bench_int_runs(ckpt_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path))
    src = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    out = main(["--checkpoint", src, "--group-size", "32", "--tokens", "4", "--repeats", "1", "--dtype", "float32",
                "--batch", "1", "3"])
    assert [(r["config"], r["batch"]) for r in out["results"]] == [("float32", 1), ("int4 g32", 1), ("float32", 3),
                                                                   ("int4 g32", 3)]
    assert out["results"][0]["vs_baseline"] == out["results"][2]["vs_baseline"] == 1.0
