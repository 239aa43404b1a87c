"""What a GPU session's calls carry to the device, made here:

    make gpu-bundle        # .gpu/perf/bundle.tar.xz and .gpu/serve/bundle.tar.xz (git-ignored)

The device image has torch, triton, transformers, numpy, grpcio and protobuf, but not
pydantic (the engine's configuration), tritonclient or a Triton server; nothing can be
fetched there, and a call carries at most 64 MiB (working tree included). So:

- `perf` (benchmarks/gpu_perf.py): pydantic and its three companions, as installed here;
- `serve` (benchmarks/gpu_serve.py): the same, tritonclient 2.51 without its two 20 MB
  perf_analyzer binaries, python-rapidjson and protobuf 4 (tritonclient's pins), and
  Triton server 2.51 from the nvidia-pytriton wheel `make tritonserver` unpacked: the
  server, its python backend, the Python 3.12 stub and the libraries they link (ldd),
  110 MB that xz packs into 25 MB.

Each bundle unpacks in the checkout's root (third_party/ is git-ignored there too): the
server where clients/tritonserver.py looks for it, the packages in third_party/site.
`PINNED_BYTES` are the parts' sizes measured on 2026-12-01 (the wheels pip downloads for
CPython 3.12 x86-64, the server's xz), which benchmarks/gpu_perf.py's dry run uses
where no bundle has been made.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib.metadata import version

BUNDLE_DIR = ".gpu"
SITE = "third_party/site"
ENGINE = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection")
CLIENT = ("tritonclient", "python-rapidjson", "protobuf")
PERF_PARTS = ("engine wheels",)
SERVE_PARTS = ("engine wheels", "client wheels", "server")
PARTS = {"engine wheels": ENGINE, "client wheels": CLIENT}
# Measured 2026-12-01: pip download --python-version 3.12 of these exact versions; the
# server's files from nvidia-pytriton 0.7.0 tarred and xz -9'd; tritonclient's wheel is
# 13.96 MB, of which its python package, all that is carried, xz's to about 0.15 MB.
PINNED_BYTES = {("pydantic", "2.14.3"): 494_071, ("pydantic-core", "2.50.4"): 2_261_727,
                ("annotated-types", "0.8.0"): 13_427, ("typing-inspection", "0.4.5"): 14_874,
                ("tritonclient", "2.51.0"): 150_000, ("python-rapidjson", "1.25"): 1_761_284,
                ("protobuf", "4.25.9"): 295_178, ("server", "nvidia-pytriton 0.7.0"): 25_180_408}
SERVER_VERSION = "nvidia-pytriton 0.7.0"
DEVICE_PYTHON = "3.12"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def setup_command(call: str) -> str:
    """What a device call runs first: unpack its bundle, then put its packages on the path."""
    return (f"tar -xJf {BUNDLE_DIR}/{call}/bundle.tar.xz && export PYTHONPATH=$PWD/{SITE}:$PWD PYTHONUNBUFFERED=1 &&")


def part_bytes(part: str) -> int:
    """The pinned size of a part, for the versions installed here."""
    if part == "server":
        return PINNED_BYTES[("server", SERVER_VERSION)]
    try:
        return sum(PINNED_BYTES[(name, version(name))] for name in PARTS[part])
    except KeyError as e:
        raise KeyError(f"no pinned size for {e.args[0]}: measure it and add it to PINNED_BYTES") from None


def call_bytes(root: str, call: str, parts: tuple[str, ...]) -> dict[str, int]:
    """{what: bytes} a call carries besides the working tree: the made bundle where
    there is one, else its parts' pinned sizes."""
    made = os.path.join(root, BUNDLE_DIR, call, "bundle.tar.xz")
    if os.path.isfile(made):
        return {f"{BUNDLE_DIR}/{call}/bundle.tar.xz (made)": os.path.getsize(made)}
    return {f"{part} (pinned)": part_bytes(part) for part in parts}


def server_files(unpacked: str) -> list[str]:
    """The server binary, the python backend, the 3.12 stub and every library of the
    wheel they link, relative to `unpacked` (third_party/pytriton)."""
    tree = "pytriton/tritonserver"
    files = [f"{tree}/bin/tritonserver", f"{tree}/backends/python/libtriton_python.so",
             f"{tree}/backends/python/triton_python_backend_utils.py",
             f"{tree}/python_backend_stubs/{DEVICE_PYTHON}/triton_python_backend_stub"]
    libs = os.path.join(unpacked, "nvidia_pytriton.libs")
    linked = set()
    for f in files:
        if f.endswith((".so", "tritonserver", "stub")):
            out = subprocess.run(["ldd", os.path.join(unpacked, f)], capture_output=True, text=True,
                                 env=dict(os.environ, LD_LIBRARY_PATH=libs)).stdout
            linked |= {os.path.basename(line.split("=>")[1].split()[0]) for line in out.splitlines()
                       if "=>" in line and "nvidia_pytriton.libs" in line}
    # dlopen'ed, not linked: DCGM and NUMA (GPU metrics), curl/ssl/xml2 (the cloud repository agents)
    for pattern in ("libdcgm-*", "libnuma-*", "libcurl-*", "libssl-*", "libxml2-*"):
        linked |= {os.path.basename(p) for p in glob.glob(os.path.join(libs, pattern))}
    return files + sorted(f"nvidia_pytriton.libs/{name}" for name in linked)


def _download(names: tuple[str, ...], dest: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           DEVICE_PYTHON, "--implementation", "cp", "-d", dest]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + [f"{n}=={version(n)}" for n in names], check=True)


def _unpack_wheels(wheels: str, site: str) -> None:
    """Each wheel's files into `site` (its .data/purelib and platlib too); no scripts or
    data files (tritonclient's perf_analyzer binaries are its only ones)."""
    for wheel in glob.glob(os.path.join(wheels, "*.whl")):
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.endswith("/"):
                    continue
                parts = member.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                target = os.path.join(site, *parts)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with z.open(member) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)


def build(root: str, call: str) -> str:
    parts = {"perf": PERF_PARTS, "serve": SERVE_PARTS}[call]
    out = os.path.join(root, BUNDLE_DIR, call, "bundle.tar.xz")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with tempfile.TemporaryDirectory() as stage:
        wheels = os.path.join(stage, "wheels")
        _download(tuple(n for p in parts if p in PARTS for n in PARTS[p]), wheels)
        _unpack_wheels(wheels, os.path.join(stage, SITE))
        members = [SITE]
        if "server" in parts:
            unpacked = os.path.join(root, "third_party", "pytriton")
            if not os.path.isfile(os.path.join(unpacked, "pytriton/tritonserver/bin/tritonserver")):
                raise SystemExit("make tritonserver first: the server comes from its unpacked wheel")
            for f in server_files(unpacked):
                target = os.path.join(stage, "third_party", "pytriton", f)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.copy2(os.path.join(unpacked, f), target)
            members.append("third_party/pytriton")
        subprocess.run(["tar", "-cf", out, "-I", "xz -9 -T0", "-C", stage, *members], check=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bundle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", nargs="+", default=["perf", "serve"], choices=["perf", "serve"])
    a = ap.parse_args(argv)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for call in a.calls:
        out = build(root, call)
        print(f"{out}: {os.path.getsize(out) / (1 << 20):.1f} MiB; on the device: {setup_command(call)} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
