"""docker-compose.yml cannot run here (no Docker engine, no GPU); check what can be
checked: mounts exist, the command is the documented one, GPU and health check set, and
what it exposes: every interface on purpose, the API key required, Triton's own ports on
the host's loopback unless asked."""

import inspect
import os
import re

import pytest
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
    readme = open(os.path.join(ROOT, "docs", "deployment.md")).read()
    assert ("python3 -m clients.tritonserver serve --host 0.0.0.0 --tritonserver /opt/tritonserver/bin/tritonserver"
            in command)
    assert "--model-repository /models" in command
    assert "python3 -m builder default --repository /models" in command
    for step in command.split("&&"):
        assert step.strip().replace("exec ", "") in readme, f"docs/deployment.md does not show: {step.strip()}"
    for req in ("requirements/gpu.txt",):
        assert os.path.isfile(os.path.join(ROOT, req))


def test_gpu_ports_and_health():
    svc = load()
    assert svc["image"] == "nvcr.io/nvidia/tritonserver:25.08-py3"
    assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert [str(p).split(":")[-1] for p in svc["ports"]] == ["8000", "8001", "8002", "8003", "9000"]
    assert "localhost:8003/ready" in " ".join(svc["healthcheck"]["test"])


def test_health_check_matches_the_supervisor():
    """The health check's port and path are the supervisor's default port and endpoint."""
    import inspect

    import clients.tritonserver as launcher
    from supervisor import status
    assert '"SUPERVISOR_PORT", 8003' in inspect.getsource(launcher.main)
    assert '"/ready"' in inspect.getsource(status.StatusServer)


def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (what this file uses)."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if op == ":?" and not env.get(name):
            raise ValueError(f"{name}: {arg}")
        if op == ":-" and not env.get(name):
            return arg
        return env.get(name, "")
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-?])([^}]*))?\}", one, value)


def test_every_interface_on_purpose():
    """The launcher listens on loopback unless told; published ports reach the container
    on its network address, so compose passes --host 0.0.0.0 itself."""
    import clients.tritonserver as launcher
    assert '"HOST", "127.0.0.1"' in inspect.getsource(launcher.main)
    serve = load()["command"][-1].split("&&")[-1].split()
    assert serve[serve.index("--host") + 1] == "0.0.0.0"


def test_api_key_required_and_no_key_written_here():
    env = load()["environment"]
    with pytest.raises(ValueError, match="API_KEY"):
        interpolate(env["API_KEY"], {})
    assert interpolate(env["API_KEY"], {"API_KEY": "k1,k2"}) == "k1,k2"
    # Optional: empty means generated at start by the launcher.
    assert interpolate(env["TRITON_ADMIN_KEY"], {}) == ""
    assert interpolate(env["TRITON_ADMIN_KEY"], {"TRITON_ADMIN_KEY": "a" * 32}) == "a" * 32
    for name, value in env.items():
        if re.search(r"KEY|TOKEN|SECRET|PASSWORD", name):
            assert re.fullmatch(r"\$\{[^}]*\}", str(value)), f"{name} holds a literal value"
    assert not re.search(r"--(api-key|admin-key)(=|\s)|restricted-api", load()["command"][-1])


def test_published_addresses():
    """The OpenAI API (API key) on every host interface; Triton's ports, whose inference
    API takes no key, and the status port on the host's loopback unless PUBLISH_ADDRESS."""
    ports = [str(p) for p in load()["ports"]]

    def published(env):
        out = {}
        for p in ports:
            parts = interpolate(p, env).split(":")
            out[parts[-1]] = parts[0] if len(parts) == 3 else "0.0.0.0"
        return out
    assert published({}) == {"8000": "127.0.0.1", "8001": "127.0.0.1", "8002": "127.0.0.1", "8003": "127.0.0.1",
                             "9000": "0.0.0.0"}
    assert set(published({"PUBLISH_ADDRESS": "0.0.0.0"}).values()) == {"0.0.0.0"}


def test_no_extra_privileges():
    svc = load()
    assert "no-new-privileges:true" in svc["security_opt"]
    assert not svc.get("privileged") and not svc.get("cap_add")
    assert svc.get("network_mode") != "host" and svc.get("pid") != "host"
