"""deploy/k8s cannot be applied here (no cluster): validate it against the Kubernetes
client's models and cross-check it with the code it deploys: the launcher's ports, the
supervisor's endpoints, the drain timings and the backend's real metric name."""

import ast
import glob
import inspect
import os
import re

import pytest
import yaml

import clients.tritonserver as launcher
from backend.triton_server.serving_config import ServerSettings
from clients.tritonserver import free_port
from supervisor.core import SupervisorOptions
from supervisor.status import SERVING, StatusServer, SupervisorStatus
from supervisor.triton_api import http_request
from tests.helpers.k8s_schema import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = sorted(glob.glob(os.path.join(ROOT, "deploy", "k8s", "*.yaml")))


def manifests() -> dict[str, dict]:
    return {d["kind"]: d for f in FILES for d in yaml.safe_load_all(open(f))}


def container() -> dict:
    return manifests()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_manifest_is_valid_kubernetes(path):
    for doc in yaml.safe_load_all(open(path)):
        assert validate(doc) == [], validate(doc)


def test_validator_is_not_blind():
    assert validate({"apiVersion": "apps/v1", "kind": "Deployment", "spec": {"replicas": "x", "selectr": {}}})


def test_ports_are_the_launchers():
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    source = inspect.getsource(launcher.main)
    for name, env in (("http", "HTTP_PORT"), ("grpc", "GRPC_PORT"), ("metrics", "METRICS_PORT"),
                      ("supervisor", "SUPERVISOR_PORT")):
        assert f'"{env}", {ports[name]}' in source, name
    service = manifests()["Service"]["spec"]["ports"]
    assert {p["targetPort"] for p in service} == set(ports)


def test_probes_hit_supervisor_endpoints_that_answer():
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["livenessProbe"]["path"] == "/live" and probes["readinessProbe"]["path"] == "/ready"
    assert {ports[p["port"]] for p in probes.values()} == {8003}
    status = SupervisorStatus()
    status.set_state(SERVING)
    port = free_port()
    server = StatusServer(port, status, lambda: True, host="127.0.0.1").start()
    try:
        for probe in probes.values():
            assert http_request(f"http://127.0.0.1:{port}{probe['path']}")[0] == 200, probe
    finally:
        server.stop()


def test_termination_grace_covers_the_drain():
    pod = manifests()["Deployment"]["spec"]["template"]["spec"]
    pre_stop = " ".join(container()["lifecycle"]["preStop"]["exec"]["command"])
    sleep_s = int(re.search(r"sleep (\d+)", pre_stop).group(1))
    drain = (sleep_s + ServerSettings().grace_period_s
             + SupervisorOptions(command=[], env={}, http_port=0).kill_after_stubs_exit_s)
    assert pod["terminationGracePeriodSeconds"] > drain + 10


def test_autoscaler_reads_a_metric_the_backend_exports():
    src = open(os.path.join(ROOT, "backend", "triton_server", "metrics.py")).read()
    tree = ast.parse(src)
    gauges = next(ast.literal_eval(n.value) for n in tree.body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "GAUGES")
    m = manifests()
    metric = m["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rules = yaml.safe_load(m["ConfigMap"]["data"]["config.yaml"])["rules"][0]
    series = rules["seriesQuery"].split("{")[0]
    assert series == "vllm:num_requests_waiting" and series in gauges
    assert re.fullmatch(rules["name"]["matches"], series) and rules["name"]["as"] == metric
    assert re.fullmatch(r"[a-z0-9_]+", metric)  # a custom-metric name: no colon
    assert m["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == m["Deployment"]["metadata"]["name"]
    labels = m["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert m["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == labels
    assert m["Service"]["spec"]["selector"] == labels
    claim = m["Deployment"]["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"]
    assert claim == m["PersistentVolumeClaim"]["metadata"]["name"]


def test_probes_documented_in_reliability_md_are_the_manifests():
    text = open(os.path.join(ROOT, "docs", "reliability.md")).read()
    documented = yaml.safe_load(re.search(r"In short:\s*```yaml\n(.*?)```", text, re.S).group(1))
    c = container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for kind, probe in documented.items():
        assert probe["httpGet"]["path"] == c[kind]["httpGet"]["path"], kind
        assert probe["httpGet"]["port"] == ports[c[kind]["httpGet"]["port"]], kind
