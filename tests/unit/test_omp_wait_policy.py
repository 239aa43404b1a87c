"""torch's OpenMP threads sleep between parallel regions unless the user says otherwise
(backend/__init__.py): libgomp reads OMP_WAIT_POLICY when torch loads, so importing the
backend first must be enough, and a user's own setting must win."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = "import backend, torch; torch.ones(64, 64) @ torch.ones(64, 64)"


def _omp_env(extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(extra, OMP_DISPLAY_ENV="TRUE")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_importing_the_backend_makes_openmp_threads_passive():
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in _omp_env({})


def test_a_users_wait_policy_wins():
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in _omp_env({"OMP_WAIT_POLICY": "ACTIVE"})
