"""clients/dynamo_local.py's argument checks (the stack itself: tests/integration/test_dynamo_serving.py)."""

from types import SimpleNamespace

import pytest

from clients import dynamo_local


@pytest.mark.parametrize("host, message", [
    ("::1", "listens on IPv4 only"),                 # the frontend and the guard's wait are IPv4
    ("0.0.0.0", "exposes the API: give it --api-key"),
])
def test_hosts_it_cannot_serve_safely_are_refused_before_anything_starts(host, message, capsys, monkeypatch):
    monkeypatch.delenv("API_KEY", raising=False)
    monkeypatch.setattr(dynamo_local, "start_services", lambda root: pytest.fail("started services"))
    with pytest.raises(SystemExit) as exit_:
        dynamo_local.main(["--host", host])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


class _FakeStack:
    """A started NATS/etcd pair whose wait fails as a taken port makes etcd fail."""

    def __init__(self, error):
        self.error, self.stopped = error, False
        self.children = [None, SimpleNamespace(process=SimpleNamespace(poll=lambda: None), port=1)]     # nats, etcd

    def wait_for(self, ready, what):
        if self.error:
            raise RuntimeError(f"etcd exited (1) while waiting for etcd:\n{self.error}")

    def stop_all(self):
        self.stopped = True


def test_services_start_again_on_fresh_ports_when_a_port_was_taken(tmp_path, monkeypatch):
    """Another process can take a free port before etcd binds it (CI's lanes side by side)."""
    made = []
    errors = iter(["listen tcp 127.0.0.1:49703: bind: address already in use", None])
    monkeypatch.setattr(dynamo_local, "_start_services", lambda root: made.append(_FakeStack(next(errors))) or made[-1])
    assert dynamo_local.start_services(str(tmp_path)) is made[1]
    assert made[0].stopped and not made[1].stopped
    # Any other failure, or the last attempt's, is raised.
    made.clear()
    errors = iter(["etcdmain: some other failure"])
    with pytest.raises(RuntimeError, match="some other failure"):
        dynamo_local.start_services(str(tmp_path))
    assert len(made) == 1 and made[0].stopped
    errors = iter(["bind: address already in use"] * 2)
    with pytest.raises(RuntimeError, match="address already in use"):
        dynamo_local.start_services(str(tmp_path), attempts=2)
