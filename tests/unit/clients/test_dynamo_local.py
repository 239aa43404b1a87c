"""clients/dynamo_local.py's argument checks (the stack itself: tests/integration/test_dynamo_serving.py)."""

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
