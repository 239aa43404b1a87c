"""The probe configuration the docs recommend points at endpoints the supervisor serves,
on the port the launcher gives it by default."""

import inspect
import os
import re
import urllib.error
import urllib.request

import yaml

import clients.tritonserver as launcher
from clients.tritonserver import free_port
from supervisor.status import SERVING, StatusServer, SupervisorStatus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def documented_probes() -> dict:
    text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
    block = re.search(r"For Kubernetes:\s*```yaml\n(.*?)```", text, re.S).group(1)
    return yaml.safe_load(block)


def test_documented_probes_hit_the_supervisor():
    probes = documented_probes()
    assert set(probes) == {"livenessProbe", "readinessProbe", "startupProbe"}
    assert probes["livenessProbe"]["httpGet"]["path"] == "/live"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    ports = {p["httpGet"]["port"] for p in probes.values()}
    assert ports == {8003} and '"SUPERVISOR_PORT", 8003' in inspect.getsource(launcher.main)
    status = SupervisorStatus()
    status.set_state(SERVING)
    port = free_port()
    server = StatusServer(port, status, lambda: True, host="127.0.0.1").start()
    try:
        for probe in probes.values():
            url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
            try:
                code = urllib.request.urlopen(url, timeout=5).status
            except urllib.error.HTTPError as e:
                code = e.code
            assert code == 200, (url, code)
    finally:
        server.stop()
