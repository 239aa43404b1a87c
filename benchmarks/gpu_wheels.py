"""Wheels a GPU machine of the device tool lacks, fetched here for it to install offline.

    make gpu-wheels                     # into .whl/ (git-ignored), for Python 3.12 x86-64

The device image has torch, triton, transformers, numpy, pytest and pytest-xdist, but
not pydantic (the engine's configuration), xgrammar (structured output) or
compressed-tensors (INT and W8A8 formats); nothing can
be fetched there. The versions are this venv's (requirements/cpu.txt's pins). On the
device, before `python -m benchmarks.gpu_check`:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=/tmp/site:$PWD
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

PACKAGES = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "xgrammar", "apache-tvm-ffi",
            # INT8/INT4 and W8A8 builds and checkpoints (with compressed-tensors' own need, loguru).
            "compressed-tensors", "loguru",
            # The image has transformers 5.17, whose references differ from the pinned 5.23 (tests/helpers/pins.py).
            "transformers",
            # NIXL's transfer bandwidth between two processes on the GPU (benchmarks/nixl_bandwidth.py).
            "nixl-cu12"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def download_command(pins: dict[str, str], dest: str, python_version: str = "3.12") -> list[str]:
    """pip download of exactly these versions, binary wheels for the device's Python."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", python_version, "--implementation", "cp", "-d", dest]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + [f"{name}=={v}" for name, v in pins.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_wheels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", default=".whl")
    ap.add_argument("--python-version", default="3.12")
    a = ap.parse_args(argv)
    pins = {name: version(name) for name in PACKAGES}
    return subprocess.run(download_command(pins, a.dest, a.python_version)).returncode


if __name__ == "__main__":
    sys.exit(main())
