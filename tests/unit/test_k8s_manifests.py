"""deploy/k8s cannot be applied here (no cluster): validate it against the Kubernetes
client's models and cross-check it with the code it deploys: the launcher's ports, the
supervisor's endpoints, the drain timings, the backend's real metric name, and the
hardening (non-root, read-only root filesystem with a volume for every writer, keys from
a Secret, deploy/Dockerfile's user and entrypoint)."""

import ast
import glob
import inspect
import json
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
DOCKERFILE = os.path.join(ROOT, "deploy", "Dockerfile")
# Variables that name a folder something writes into at run time.
WRITABLE_ENV = ("HOME", "XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR", "CUDA_CACHE_PATH",
                "TORCHINDUCTOR_CACHE_DIR", "TMPDIR")


def manifests() -> dict[str, dict]:
    """The one-pod deployment's manifests by kind (the multi-node group has its own file
    and checks: test_k8s_leaderworkerset.py)."""
    return {d["kind"]: d for f in FILES if not f.endswith("leaderworkerset.yaml") for d in yaml.safe_load_all(open(f))}


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
                      ("supervisor", "SUPERVISOR_PORT"), ("openai", "OPENAI_PORT")):
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


def pod_spec() -> dict:
    return manifests()["Deployment"]["spec"]["template"]["spec"]


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [ln for ln in open(DOCKERFILE).read().splitlines() if not ln.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)]


def dockerfile_env() -> dict[str, str]:
    env = {}
    for inst, arg in dockerfile():
        if inst == "ENV":
            env.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\S+)", arg))
    return env


def test_pod_and_container_run_unprivileged():
    pod, c = pod_spec()["securityContext"], container()["securityContext"]
    for ctx in (pod, c):
        assert ctx["runAsNonRoot"] is True
        assert ctx["runAsUser"] == 1000 and ctx["runAsGroup"] == 1000
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["fsGroup"] == 1000
    assert c["allowPrivilegeEscalation"] is False
    assert c.get("privileged", False) is False
    assert c["capabilities"] == {"drop": ["ALL"]}  # and nothing added back
    assert c["readOnlyRootFilesystem"] is True
    assert pod_spec().get("hostNetwork", False) is False and pod_spec().get("hostPID", False) is False
    assert pod_spec()["automountServiceAccountToken"] is False


def test_every_written_path_is_a_writable_volume():
    """The root filesystem is read-only: /tmp, /dev/shm and every cache folder the
    container is pointed at must lie on a writable emptyDir."""
    c = container()
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    mounts = c["volumeMounts"]
    assert {m["name"] for m in mounts} <= set(volumes)
    writable = [m["mountPath"].rstrip("/") for m in mounts
                if not m.get("readOnly") and "emptyDir" in volumes[m["name"]]]

    def on_writable(path: str) -> bool:
        return any(path == w or path.startswith(w + "/") for w in writable)

    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    # The kernel cache of OpenAI Triton (the backend's kernels), $HOME and Hugging Face's.
    assert {"HOME", "TRITON_CACHE_DIR", "HF_HOME"} <= set(env)
    for path in ["/tmp", "/dev/shm"] + [env[k] for k in WRITABLE_ENV if k in env]:
        assert on_writable(path), f"{path} is not on a writable emptyDir volume"
    # The image points its writers at the same folders (docker run sees them too).
    image_env = dockerfile_env()
    for k in WRITABLE_ENV:
        if k in env or k in image_env:
            assert image_env.get(k) == env.get(k), k
    # The model repository is only read.
    assert next(m for m in mounts if m["mountPath"] == "/models").get("readOnly") is True


def test_keys_come_from_the_secret():
    c = container()
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs["TRITON_ADMIN_KEY"] == {"name": "paged-llm-keys", "key": "admin-key"}
    assert refs["API_KEY"] == {"name": "paged-llm-keys", "key": "api-keys"}
    for e in c["env"]:
        if re.search(r"KEY|TOKEN|SECRET|PASSWORD", e["name"]) and "FILE" not in e["name"]:
            assert "value" not in e, f"{e['name']} is written in the manifest"
    # No key on a command line (readable by every process in the pod), no checked-in Secret.
    assert not any(re.match(r"--(api-key|admin-key)(=|$)|--(http|grpc)-restricted", a) for a in c["args"])
    assert "Secret" not in manifests()


def test_every_interface_on_purpose():
    """The launcher listens on loopback unless told; in a pod, kubelet's probes, the
    Service and Prometheus come in on the pod's address."""
    assert '"HOST", "127.0.0.1"' in inspect.getsource(launcher.main)
    args = container()["args"]
    assert args[args.index("--host") + 1] == "0.0.0.0"
    entrypoint = json.loads(next(arg for inst, arg in dockerfile() if inst == "ENTRYPOINT"))
    assert entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"


def test_image_runs_as_the_manifests_non_root_user():
    users = [arg for inst, arg in dockerfile() if inst == "USER"]
    assert users, "deploy/Dockerfile has no USER: it would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root uid (runAsNonRoot checks it without /etc/passwd)"
    ctx = container()["securityContext"]
    assert (int(uid), int(gid or uid)) == (ctx["runAsUser"], ctx["runAsGroup"])


def test_image_build_context_leaves_out_secrets_and_local_state():
    ignored = {ln.strip() for ln in open(DOCKERFILE + ".dockerignore") if ln.strip() and not ln.startswith("#")}
    assert {".env", ".git", ".venv", "third_party"} <= ignored


def test_service_exposes_the_openai_api():
    ports = {p["name"]: p for p in manifests()["Service"]["spec"]["ports"]}
    assert ports["openai"]["port"] == 9000 and ports["openai"]["targetPort"] == "openai"
    assert manifests()["Service"]["spec"].get("type", "ClusterIP") == "ClusterIP"
