"""deploy/dynamo cannot run here (no Docker engine, no cluster, no GPU): check what can be
checked. The compose profiles and the DynamoGraphDeployments start the processes the
tests start, with arguments our worker's and the guard's parsers accept; only the
guarded port is exposed, and it needs the API key; the pods' containers and pod specs
are valid Kubernetes (the official client's models); the services have the shape of
Dynamo's documented DynamoGraphDeployment examples (its CRD, 1.6 MB, is not vendored)."""

import os
import shlex

import jsonschema
import kubernetes.client as k8s
import pytest
import yaml

from backend.dynamo_worker.__main__ import parse_args as worker_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPOSE = os.path.join(ROOT, "deploy", "dynamo", "docker-compose.yml")
DGDS = {name: os.path.join(ROOT, "deploy", "dynamo", "k8s", f"{name}.yaml") for name in ("agg", "disagg")}

# The DynamoGraphDeployment shape Dynamo's own examples use (examples/backends/*/deploy/),
# strictly: an unknown or misspelt key fails.
DGD_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "nvidia.com/v1alpha1"}, "kind": {"const": "DynamoGraphDeployment"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["services"], "additionalProperties": False, "properties": {
            "services": {"type": "object", "additionalProperties": {
                "type": "object", "required": ["componentType", "extraPodSpec"], "additionalProperties": False,
                "properties": {
                    "componentType": {"enum": ["frontend", "worker"]},
                    "subComponentType": {"enum": ["prefill", "decode"]},
                    "replicas": {"type": "integer", "minimum": 1},
                    "envFromSecret": {"type": "string"},
                    "envs": {"type": "array", "items": {"type": "object", "required": ["name"]}},
                    "resources": {"type": "object", "properties": {"limits": {"type": "object"}}},
                    "extraPodSpec": {"type": "object", "required": ["mainContainer"]},
                }}}}},
    },
}


def compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)["services"]


def dgd(name: str) -> dict:
    with open(DGDS[name]) as f:
        return yaml.safe_load(f)


def services_of(profile: str) -> dict:
    return {name: svc for name, svc in compose().items() if profile in svc.get("profiles", [])}


def test_each_profile_starts_dynamos_services_a_guarded_frontend_and_its_workers():
    agg, disagg = services_of("aggregated"), services_of("disaggregated")
    assert set(agg) == {"nats", "etcd", "frontend", "guard", "worker-0", "worker-1"}
    assert set(disagg) == {"nats", "etcd", "frontend", "guard", "prefill", "decode"}
    modes = {name: worker_args(svc["command"]).disaggregation_mode
             for name, svc in compose().items() if svc.get("entrypoint", [])[-1:] == ["backend.dynamo_worker"]}
    assert modes == {"worker-0": "aggregated", "worker-1": "aggregated", "prefill": "prefill", "decode": "decode"}
    # (one GPU each, different ones)
    gpus = {name: compose()[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name in modes}
    assert gpus["worker-0"] != gpus["worker-1"] and gpus["prefill"] != gpus["decode"]


def test_compose_publishes_only_the_guard_and_it_needs_the_key():
    services = compose()
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert list(published) == ["frontend"]      # the guard shares the frontend's network namespace
    assert services["guard"]["network_mode"] == "service:frontend"
    assert published["frontend"][0].endswith(":8080")
    guard = services["guard"]
    assert guard["command"][:2] == ["--listen", "0.0.0.0:8080"] and "127.0.0.1:8000" in guard["command"]
    assert "--openai-only" in guard["command"]
    assert "${API_KEY:?" in guard["environment"]["API_KEY"]
    frontend = services["frontend"]["command"]
    assert frontend[frontend.index("--http-host") + 1] == "127.0.0.1"
    assert frontend[frontend.index("--http-port") + 1] == "8000"
    for name in ("nats", "etcd"):
        assert "ports" not in services[name]


def test_the_compose_model_repository_is_the_projects():
    for svc in compose().values():
        for volume in svc.get("volumes", []):
            host = volume.split(":")[0]
            assert os.path.normpath(os.path.join(ROOT, "deploy", "dynamo", host)) == os.path.join(ROOT,
                                                                                                  "model_repository")


@pytest.mark.parametrize("name", sorted(DGDS))
def test_dgd_has_dynamos_documented_shape_and_valid_pods(name):
    doc = dgd(name)
    jsonschema.validate(doc, DGD_SCHEMA)
    for service, spec in doc["spec"]["services"].items():
        pod = dict(spec["extraPodSpec"])
        main = pod.pop("mainContainer")
        containers = [{"name": "main", **main}] + pod.pop("containers", [])
        k8s.V1PodSpec.model_validate({**pod, "containers": containers})


def test_dgd_schema_is_not_blind():
    bad = dgd("agg")
    bad["spec"]["services"]["Frontend"]["componentTyp"] = "frontend"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, DGD_SCHEMA)


@pytest.mark.parametrize("name, roles", [("agg", {"aggregated"}), ("disagg", {"prefill", "decode"})])
def test_dgd_workers_run_our_worker_in_their_role_on_the_pods_address(name, roles):
    seen = set()
    for spec in dgd(name)["spec"]["services"].values():
        main = spec["extraPodSpec"]["mainContainer"]
        if spec["componentType"] != "worker":
            continue
        assert main["command"] == ["python3", "-m", "backend.dynamo_worker"]
        args = worker_args(main["args"])
        seen.add(args.disaggregation_mode)
        assert spec.get("subComponentType", "aggregated") == args.disaggregation_mode
        assert args.host == "$(POD_IP)"             # (Kubernetes expands it from the env below)
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in main["env"]
        claim = next(v for v in spec["extraPodSpec"]["volumes"] if v["name"] == "models")
        with open(os.path.join(ROOT, "deploy", "k8s", "pvc.yaml")) as f:
            assert claim["persistentVolumeClaim"]["claimName"] == yaml.safe_load(f)["metadata"]["name"]
    assert seen == roles


@pytest.mark.parametrize("name", sorted(DGDS))
def test_dgd_frontend_sits_behind_the_guard_with_the_deployments_key(name):
    frontend = dgd(name)["spec"]["services"]["Frontend"]
    main = frontend["extraPodSpec"]["mainContainer"]
    assert main["command"] == ["python3", "-m", "dynamo.frontend"]
    assert main["args"][main["args"].index("--http-host") + 1] == "127.0.0.1"
    guard = frontend["extraPodSpec"]["containers"][0]
    assert guard["command"] == ["python3", "-m", "frontend.http_guard"]
    upstream = guard["args"][guard["args"].index("--upstream") + 1]
    assert upstream == f"127.0.0.1:{main['args'][main['args'].index('--http-port') + 1]}"
    with open(os.path.join(ROOT, "deploy", "k8s", "deployment.yaml")) as f:
        deployment = yaml.safe_load(f)
    keys = {e["name"]: e["valueFrom"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            if "valueFrom" in e}
    assert guard["env"][0]["name"] == "API_KEY" and guard["env"][0]["valueFrom"] == keys["API_KEY"]
    assert shlex.join(guard["args"]).startswith("--listen 0.0.0.0:8000") and "--openai-only" in guard["args"]
