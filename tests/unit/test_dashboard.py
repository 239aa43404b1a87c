"""deploy/monitoring: the Grafana dashboard is make_dashboard.py's output, parses, and
queries only metrics the code exports (a real server's /metrics:
tests/integration/test_dashboard_metrics.py); the compose profile mounts what exists,
keeps Prometheus and Grafana on the host's loopback and requires Grafana's password."""

import importlib.util
import json
import os
import re

import yaml

from tests.helpers.dashboard import DASHBOARD, ROOT, queried_families

MONITORING = os.path.join(ROOT, "deploy", "monitoring")
# Triton's own families the dashboard reads (tritonserver's standard metrics).
TRITON_FAMILIES = {"nv_inference_request_success", "nv_inference_request_failure"}


def maker():
    spec = importlib.util.spec_from_file_location("make_dashboard", os.path.join(MONITORING, "make_dashboard.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exported_families() -> set[str]:
    """Every family name the backend's metrics modules declare."""
    found = set()
    for path in ("backend/triton_server/metrics.py", "backend/triton_server/priority_metrics.py"):
        found |= set(re.findall(r'"((?:vllm:|llm_)[a-z0-9_:]+)"', open(os.path.join(ROOT, path)).read()))
    return found


def test_the_dashboard_is_the_scripts_output_and_parses():
    with open(DASHBOARD) as f:
        text = f.read()
    assert text == maker().render(), "run: python deploy/monitoring/make_dashboard.py"
    dashboard = json.loads(text)
    titles = {p["title"] for p in dashboard["panels"]}
    for wanted in ("Tokens per second", "Time to first token", "Inter-token latency", "Requests running and waiting",
                   "KV cache usage", "Prefix cache hit rate", "Preemptions per second",
                   "Speculative decoding acceptance", "LoRA adapters running and waiting"):
        assert wanted in titles


def test_every_queried_metric_is_exported():
    queried = queried_families(json.loads(maker().render()))
    assert queried - TRITON_FAMILIES <= exported_families(), queried - TRITON_FAMILIES - exported_families()
    assert "vllm:time_to_first_token_seconds" in queried


def test_the_monitoring_profile():
    with open(os.path.join(ROOT, "docker-compose.yml")) as f:
        services = yaml.safe_load(f)["services"]
    for name in ("prometheus", "grafana"):
        svc = services[name]
        assert svc["profiles"] == ["monitoring"]
        assert all(p.startswith("127.0.0.1:") for p in svc["ports"])
        for volume in svc["volumes"]:
            assert os.path.exists(os.path.join(ROOT, volume.split(":")[0])), volume
    assert services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    with open(os.path.join(MONITORING, "prometheus.yml")) as f:
        targets = {j["job_name"]: j["static_configs"][0]["targets"][0] for j in yaml.safe_load(f)["scrape_configs"]}
    assert targets["triton"] == "triton:8002" and targets["openai-frontend"] == "triton:9000"
