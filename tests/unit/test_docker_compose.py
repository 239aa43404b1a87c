"""docker-compose.yml cannot run here (no Docker engine, no GPU); check what can be
checked: mounts exist, the command is the documented one, GPU and health check set."""

import os

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load():
    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        return yaml.safe_load(f)["services"]["triton"]


def test_mounted_paths_exist():
    for volume in load()["volumes"]:
        host = volume.split(":")[0]
        assert os.path.exists(os.path.join(ROOT, host)), host
    # The backend mount must be a python-based backend folder.
    assert os.path.isfile(os.path.join(ROOT, "backend/triton_server/model.py"))


def test_command_is_the_documented_one():
    svc = load()
    command = svc["command"][-1]
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "python3 -m clients.tritonserver serve --tritonserver /opt/tritonserver/bin/tritonserver" in command
    assert "--model-repository /models" in command
    assert "python3 -m builder default --repository /models" in command
    for step in command.split("&&"):
        assert step.strip().replace("exec ", "") in readme, f"README does not show: {step.strip()}"
    for req in ("requirements/gpu.txt",):
        assert os.path.isfile(os.path.join(ROOT, req))


def test_gpu_ports_and_health():
    svc = load()
    assert svc["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert [p.split(":")[-1] for p in svc["ports"]] == ["8000", "8001", "8002", "8003", "9000"]
    assert "localhost:8003/ready" in " ".join(svc["healthcheck"]["test"])


def test_health_check_matches_the_supervisor():
    """The health check's port and path are the supervisor's default port and endpoint."""
    import inspect

    import clients.tritonserver as launcher
    from supervisor import status
    assert '"SUPERVISOR_PORT", 8003' in inspect.getsource(launcher.main)
    assert '"/ready"' in inspect.getsource(status.StatusServer)
