"""backend/dynamo_worker/__main__.py: where Dynamo's planes and NIXL listen (loopback
unless asked), Dynamo's own variables as defaults, and a clear error for a folder that
is not a model repository entry."""

import pytest

from backend.dynamo_worker import __main__ as worker_main

VARIABLES = worker_main.HOST_VARIABLES + ("UCX_NET_DEVICES", "DYN_NAMESPACE", "DYN_DISCOVERY_BACKEND")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Each variable unset here, and put back as it was afterwards (main() sets them)."""
    for name in VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_planes_and_nixl_stay_on_loopback_by_default(tmp_path, capsys, monkeypatch):
    pytest.importorskip("dynamo.llm")
    assert worker_main.main(["--model-repository", str(tmp_path)]) == 2
    assert "no config.pbtxt" in capsys.readouterr().err
    import os
    assert all(os.environ[name] == "127.0.0.1" for name in worker_main.HOST_VARIABLES)
    assert os.environ["UCX_NET_DEVICES"] == "lo"


def test_a_pods_address_is_used_as_given_and_auto_leaves_dynamo_to_choose(tmp_path, monkeypatch):
    pytest.importorskip("dynamo.llm")
    import os
    worker_main.main(["--model-repository", str(tmp_path), "--host", "10.1.2.3"])
    assert os.environ["DYN_TCP_RPC_HOST"] == "10.1.2.3" and "UCX_NET_DEVICES" not in os.environ
    for name in worker_main.HOST_VARIABLES:
        monkeypatch.delenv(name)
    worker_main.main(["--model-repository", str(tmp_path), "--host", "auto"])
    assert not any(name in os.environ for name in worker_main.HOST_VARIABLES)


def test_dynamos_variables_are_the_defaults(monkeypatch):
    monkeypatch.setenv("DYN_NAMESPACE", "team-a")
    monkeypatch.setenv("DYN_DISCOVERY_BACKEND", "kubernetes")
    args = worker_main.parse_args(["--model-repository", "r"])
    assert (args.namespace, args.discovery_backend, args.disaggregation_mode) == ("team-a", "kubernetes", "aggregated")
