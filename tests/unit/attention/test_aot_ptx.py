"""The paged-attention kernel compiles to PTX for Hopper (sm_90) on a machine without a
GPU, with the entry point a TensorRT AOT plugin launches (inputs, int32 scalars,
outputs: nothing else), gpt-oss's sinks read from the node's last input (moved there from
after the kernel's outputs), and ptxas assembles that PTX."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_kernel_compiles_to_sm90_ptx_with_the_plugin_entry(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Keep every import location of this process: on some machines the packages live
    # outside site-packages (a PYTHONPATH of their own).
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    proc = subprocess.run([sys.executable, "-m", "backend.attention.aot", "--arch", "90", "--sinks", "--out",
                           str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = (tmp_path / "paged_attention.sm_90.ptx").read_text()
    assert ".target sm_90" in ptx
    from backend.attention.aot import NODE_INPUTS, NODE_OUTPUTS, SCALAR_ARGS, entry_params
    name = re.search(r"\.entry\s+(\w+)", ptx).group(1)
    params = entry_params(ptx, name)
    assert len(params) == len(NODE_INPUTS) + len(SCALAR_ARGS) + len(NODE_OUTPUTS) == 25
    # The node's sinks input is the kernel's parameter after its 11 inputs, 10 scalars and
    # 3 outputs (index 24), read in the body; the others keep their order.
    assert params[11] == f"{name}_param_24" and f"[{params[11]}]" in ptx
    assert params[:11] + params[12:] == [f"{name}_param_{i}" for i in range(24)]
    # Pointers for the 12 inputs, 32-bit scalars, pointers for the 3 outputs.
    decls = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S).group(1).split(",")
    kinds = [".u32" in d for d in decls]
    assert kinds == [False] * 12 + [True] * 10 + [False] * 3
    assert (tmp_path / "paged_attention.sm_90.cubin").stat().st_size > 0
    # The FP8 path really uses the E4M3 conversion instructions.
    assert "e4m3" in ptx
