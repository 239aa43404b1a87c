"""benchmarks/kernel_resources.py compiles the INT4 GEMMs for sm_90 without a GPU and
reads ptxas' report: at a decode tile the blocked kernel spills nothing, converts no
weight instruction by instruction, and leaves room for several programs per SM."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_decode_tile_resources():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    proc = subprocess.run([sys.executable, "-m", "benchmarks.kernel_resources", "--rows", "1"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in proc.stdout.splitlines() if line.startswith("| gathering") or line.startswith("| blocked")}
    assert set(rows) == {"gathering", "blocked"}
    # columns: M, tile, warps, registers, spills, shared, blocks/SM, MMAs, weight converts, global loads
    blocked, gathering = rows["blocked"], rows["gathering"]
    assert blocked[4] == "0" and blocked[8] == "0" and int(blocked[7]) > 0
    assert int(blocked[6]) >= 4 and int(blocked[3]) < int(gathering[3])
