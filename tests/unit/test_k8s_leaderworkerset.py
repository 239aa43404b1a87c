"""deploy/k8s/leaderworkerset.yaml (a model over several machines, docs/multi-node.md)
cannot be applied here: it is validated with the others (test_k8s_manifests.py, against
the LeaderWorkerSet CRD's schema and the client's pod models), and cross-checked here with
the code it runs: the worker's command parses as the headless node command with the
variables LeaderWorkerSet sets, the rendezvous port is the engine's and the command's
default, the entry's build command fits the group (nnodes = size, ranks per node = GPUs
per pod), and both pods keep the single-pod deployment's hardening."""

import os
import re
import shlex

import yaml

from backend.config import EngineArgs
from backend.parallel import node
from builder.__main__ import main as builder_main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = os.path.join(ROOT, "deploy", "k8s", "leaderworkerset.yaml")
LWS_ENV = {"LWS_LEADER_ADDRESS": "paged-llm-pp-0.paged-llm-pp.default", "LWS_WORKER_INDEX": "1",
           "LWS_GROUP_SIZE": "2"}


def docs() -> dict:
    return {d["kind"]: d for d in yaml.safe_load_all(open(PATH))}


def templates() -> tuple[dict, dict]:
    lwt = docs()["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    return lwt["leaderTemplate"], lwt["workerTemplate"]


def env(container: dict) -> dict:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def expand(arg: str, variables: dict) -> str:
    """Kubernetes' $(VAR) expansion in command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], arg)


def test_worker_runs_the_headless_node_command(monkeypatch):
    leader, worker = (t["spec"]["containers"][0] for t in templates())
    assert worker["image"] == leader["image"]
    assert worker["command"][1:] == ["-m", "backend.parallel.node"]
    for k, v in env(worker).items():
        monkeypatch.setenv(k, v)
    args = node.parse_args([expand(a, LWS_ENV) for a in worker["args"]])
    assert (args.master_addr, args.node_rank, args.nnodes) == ("paged-llm-pp-0.paged-llm-pp.default", 1, 2)
    # The port the leader serves: its containerPort, the engine's default and the command's.
    rendezvous = next(p["containerPort"] for p in leader["ports"] if p["name"] == "rendezvous")
    assert args.master_port == rendezvous == int(env(leader)["MASTER_PORT"])
    monkeypatch.delenv("MASTER_PORT")
    assert node.parse_args(["--master-addr", "x", "--node-rank", "1"]).master_port == rendezvous
    assert EngineArgs.create(model="m", nnodes=2, tensor_parallel_size=2).master_port is None   # -> env, else 29500


def test_the_entry_fits_the_group(capsys):
    """The build command in the manifest's header: the builder takes its flags (it stops
    only at the checkpoint, absent here), the engine its sizes; nnodes is the group's size,
    and each node's ranks (tensor x pipeline / nnodes) are the GPUs each pod asks for."""
    text = open(PATH).read()
    command = shlex.split(re.search(r"#\s+(python -m builder build .*)", text).group(1))
    assert builder_main(command[3:]) == 2
    assert "has no config.json" in capsys.readouterr().err
    flags = dict(zip(command[4::2], command[5::2]))
    opts = EngineArgs.create(model="m", tensor_parallel_size=int(flags["--tensor-parallel-size"]),
                             pipeline_parallel_size=int(flags["--pipeline-parallel-size"]),
                             nnodes=int(flags["--nnodes"]))
    lws = docs()["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert opts.nnodes == lws["size"]
    per_node = opts.tensor_parallel_size * opts.pipeline_parallel_size // opts.nnodes
    for t in templates():
        resources = t["spec"]["containers"][0]["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) == per_node == int(resources["requests"]["nvidia.com/gpu"])
    assert lws["restartPolicy"] == "RecreateGroupOnPodRestart"     # a dead worker restarts the group


def test_both_pods_are_hardened_and_read_the_same_model_repository():
    for t in templates():
        pod, c = t["spec"], t["spec"]["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
        ctx = c["securityContext"]
        assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        models = next(m for m in c["volumeMounts"] if m["name"] == "models")
        # The checkpoint path the leader publishes is read at the same place on every node.
        assert models == {"name": "models", "mountPath": "/models", "readOnly": True}
        assert {"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} <= set(env(c))
    service = docs()["Service"]["spec"]
    leader = templates()[0]
    assert service["selector"].items() <= leader["metadata"]["labels"].items()
    assert service["selector"]["role"] == "leader" != templates()[1]["metadata"]["labels"]["role"]
    assert {p["targetPort"] for p in service["ports"]} <= {p["name"] for p in leader["spec"]["containers"][0]["ports"]}
