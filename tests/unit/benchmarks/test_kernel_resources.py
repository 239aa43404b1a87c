"""benchmarks/kernel_resources.py compiles the INT4 GEMMs and the MXFP4 MoE for sm_90
without a GPU and reads ptxas' report: at a decode tile the blocked kernel spills nothing,
converts no weight instruction by instruction, and leaves room for several programs per
SM; the MoE's `tl.dot_scaled` tile decodes no code by exp2 and reads each byte once."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_decode_tile_resources():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernel_resources", "--rows", "1", "--moe-rows", "16"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith(("| gathering", "| blocked", "| mxfp4"))}
    assert set(rows) == {"gathering", "blocked", "mxfp4 decoded", "mxfp4 dot_scaled"}
    # columns: M, tile, warps, registers, spills, shared, blocks/SM, MMAs, weight converts, global loads, exp2,
    # cp.async (the K loop pipelined: the compile is specialized as a launch on aligned tensors)
    blocked, gathering = rows["blocked"], rows["gathering"]
    assert blocked[4] == "0" and blocked[8] == "0" and int(blocked[7]) > 0
    assert int(blocked[6]) >= 4 and int(blocked[3]) < int(gathering[3]) and int(blocked[11]) > 0
    # The MoE: exp2s left are the SwiGLU's sigmoid (4), against 2 a decoded code.
    scaled, decoded = rows["mxfp4 dot_scaled"], rows["mxfp4 decoded"]
    assert scaled[4] == "0" and scaled[8] == "0" and int(scaled[7]) > 0 and int(scaled[11]) > 0
    assert int(scaled[10]) <= 8 < int(decoded[10]) and int(scaled[9]) < int(decoded[9]) / 2
