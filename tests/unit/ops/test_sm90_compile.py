"""The fused layer kernels, the tiled attention kernel, the LoRA SGMV kernel, the fused MoE
kernel, the INT4/INT8 GEMM, the W8A8 INT8 GEMM and the block FP8 GEMM compile for Hopper
(sm_90) on a machine without a GPU, and the bf16 attention, INT GEMM and fused MoE tiles
run on tensor cores (MMA in the PTX), the W8A8 tiles on the INT8 MMA (mma.sync s32.s8.s8
for decode tiles, Hopper's wgmma for 64-row tiles), the block FP8 64-row tiles on the
e4m3 wgmma. The interpreter cannot check either."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_kernels_compile_for_sm90_with_tensor_core_tiles():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    proc = subprocess.run([sys.executable, "-m", "tests.helpers.compile_sm90"], env=env, capture_output=True,
                          text=True, timeout=500, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "bf16 tiles on tensor cores: True" in proc.stdout
