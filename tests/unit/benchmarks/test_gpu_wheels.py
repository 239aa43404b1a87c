"""benchmarks/gpu_wheels.py: the pip command that fetches the device's missing wheels (not
run: no download in tests)."""

from benchmarks.gpu_wheels import PACKAGES, download_command


def test_download_pins_every_package_for_the_devices_python():
    pins = {name: "1.2.3" for name in PACKAGES}
    cmd = download_command(pins, "/tmp/w")
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("-d") + 1] == "/tmp/w" and "manylinux_2_28_x86_64" in cmd
    assert [c for c in cmd if "==" in c] == [f"{name}==1.2.3" for name in PACKAGES]
    assert "pydantic" in PACKAGES and "xgrammar" in PACKAGES
