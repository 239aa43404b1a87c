"""What importing the backend sets before torch loads, and that a user's own setting wins:
torch's OpenMP threads sleep between parallel regions (libgomp reads OMP_WAIT_POLICY when
torch loads), and large tensors go on transparent huge pages (backend/__init__.py)."""

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


THP_PROBE = ("import backend, torch; xs = [torch.empty(3 << 20, dtype=torch.uint8) for _ in range(3)]; "
             "print(all(x.data_ptr() % 4096 == 0 for x in xs))")


def _thp_aligned(extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", THP_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_backend_puts_large_tensors_on_huge_pages():
    """Once THP_MEM_ALLOC_ENABLE is set before its first allocation, torch's allocator
    page-aligns tensors of 2 MiB and more and advises THP for them (its 64-byte default
    alignment puts three in a row on page boundaries once in 2^18); a user's 0 wins."""
    assert _thp_aligned({}) == "True"
    assert _thp_aligned({"THP_MEM_ALLOC_ENABLE": "0"}) == "False"
