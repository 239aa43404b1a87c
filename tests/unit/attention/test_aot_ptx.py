"""The paged-attention and KV-write kernels compile to PTX for Hopper (sm_90) on a
machine without a GPU (FP8 cache and bf16 activations, the served configuration)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_kernels_compile_to_sm90_ptx(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, "-m", "backend.attention.aot", "--arch", "90", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("paged_attention", "write_kv"):
        ptx = (tmp_path / f"{name}.sm_90.ptx").read_text()
        assert ".target sm_90" in ptx and ".entry" in ptx
    # The FP8 path really uses the E4M3 conversion instructions.
    assert "e4m3" in (tmp_path / "write_kv.sm_90.ptx").read_text()
