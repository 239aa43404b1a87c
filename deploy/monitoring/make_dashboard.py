"""Writes deploy/monitoring/grafana/paged-llm.json, the Grafana dashboard of the metrics
the server exports (docs/metrics.md, docs/reference/metrics.md): `python deploy/monitoring/make_dashboard.py`.

Kept as code so that each panel's query is one line here; tests/unit/test_dashboard.py
checks the JSON is this script's output and that every metric it queries is one the
code exports (and tests/integration/test_dashboard_metrics.py, a real server's)."""

from __future__ import annotations

import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grafana", "paged-llm.json")
DS = {"type": "prometheus", "uid": "${datasource}"}


def quantiles(metric: str, unit_scale: str = "") -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{model=~\"$model\"}}[$__rate_interval])))"
             f"{unit_scale}", f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]


# (title, unit, [(PromQL, legend)])
PANELS = [
    ("Tokens per second", "short", [
        ("sum(rate(vllm:generation_tokens_total{model=~\"$model\"}[$__rate_interval]))", "generated"),
        ("sum(rate(vllm:prompt_tokens_total{model=~\"$model\"}[$__rate_interval]))", "prompt")]),
    ("Time to first token", "s", quantiles("vllm:time_to_first_token_seconds")),
    ("Inter-token latency", "s", quantiles("vllm:time_per_output_token_seconds")),
    ("End-to-end request latency", "s", quantiles("vllm:e2e_request_latency_seconds")),
    ("Requests running and waiting", "short", [
        ("sum(vllm:num_requests_running{model=~\"$model\"})", "running"),
        ("sum(vllm:num_requests_waiting{model=~\"$model\"})", "waiting (queue depth)")]),
    ("KV cache usage", "percentunit", [
        ("max(vllm:kv_cache_usage_perc{model=~\"$model\"})", "device pool")]),
    ("Prefix cache hit rate", "percentunit", [
        ("sum(rate(vllm:prefix_cache_hits_total{model=~\"$model\"}[$__rate_interval])) / "
         "sum(rate(vllm:prefix_cache_queries_total{model=~\"$model\"}[$__rate_interval]))", "hit rate")]),
    ("Preemptions per second", "short", [
        ("sum(rate(vllm:num_preemptions_total{model=~\"$model\"}[$__rate_interval]))", "preemptions")]),
    ("Speculative decoding acceptance", "percentunit", [
        ("avg(llm_spec_decode_acceptance_rate{model=~\"$model\"})", "acceptance rate")]),
    # (the info gauge's value is a timestamp: count its series, labelled by the adapters)
    ("LoRA adapters running and waiting", "short", [
        ("count by (running_lora_adapters, waiting_lora_adapters) (vllm:lora_requests_info{model=~\"$model\"})",
         "running: {{running_lora_adapters}} waiting: {{waiting_lora_adapters}}")]),
    ("Triton: inferences per second", "reqps", [
        ("sum(rate(nv_inference_request_success{model=~\"$model\"}[$__rate_interval]))", "succeeded"),
        ("sum(rate(nv_inference_request_failure{model=~\"$model\"}[$__rate_interval]))", "failed")]),
    ("Requests refused", "reqps", [
        ("sum by (reason) (rate(llm_requests_rejected_total{model=~\"$model\"}[$__rate_interval]))", "{{reason}}")]),
]


def dashboard() -> dict:
    panels = []
    for i, (title, unit, queries) in enumerate(PANELS):
        panels.append({
            "id": i + 1, "type": "timeseries", "title": title, "datasource": DS,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(ord("A") + j), "datasource": DS, "expr": expr, "legendFormat": legend}
                        for j, (expr, legend) in enumerate(queries)]})
    return {
        "title": "paged_llm", "uid": "paged-llm", "schemaVersion": 39, "version": 1, "editable": True,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["paged_llm", "vllm", "triton"],
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "model", "type": "query", "datasource": DS, "label": "model", "includeAll": True,
             "multi": True, "allValue": ".*", "refresh": 2,
             "definition": "label_values(vllm:num_requests_running, model)",
             "query": {"query": "label_values(vllm:num_requests_running, model)", "refId": "models"}}]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1) + "\n"


if __name__ == "__main__":
    with open(OUT, "w") as f:
        f.write(render())
    print(f"wrote {OUT}")
