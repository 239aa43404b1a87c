"""What `serve` tells tritonserver and the processes beside it: addresses, and Triton's gRPC
TLS for the OpenAI frontend (clients/tritonserver.py)."""

import pytest

from clients.tritonserver import frontend_tls_args, local_address


def test_frontend_trusts_the_server_certificate_or_the_root(monkeypatch):
    monkeypatch.delenv("TRITON_GRPC_ROOT_CERT", raising=False)
    assert frontend_tls_args([]) == []
    assert frontend_tls_args(["--grpc-use-ssl=false", "--grpc-server-cert", "s.pem"]) == []
    assert frontend_tls_args(["--grpc-use-ssl", "true", "--grpc-server-cert", "s.pem"]) == \
        ["--triton-ssl-root-cert", "s.pem"]
    assert frontend_tls_args(["--grpc-use-ssl=1", "--grpc-server-cert=s.pem", "--grpc-root-cert", "ca.pem"]) == \
        ["--triton-ssl-root-cert", "ca.pem"]
    monkeypatch.setenv("TRITON_GRPC_ROOT_CERT", "mine.pem")      # the frontend reads it itself
    assert frontend_tls_args(["--grpc-use-ssl=true", "--grpc-server-cert", "s.pem"]) == []


def test_local_address():
    assert local_address("0.0.0.0") == "127.0.0.1" and local_address("10.1.2.3") == "10.1.2.3"
    # IPv6 literals go in brackets, or `http://::1:8000` and the gRPC target `::1:8001` break.
    assert local_address("::1") == "[::1]" and local_address("::") == "[::1]"
    assert local_address("fd00::5") == "[fd00::5]" and local_address("[::1]") == "[::1]"


def test_tritonserver_is_told_an_ipv6_host_in_each_servers_own_form():
    """Checked against a real tritonserver 24.10 (`make serve HOST=::1`, 2026-11-30): its
    HTTP and metrics servers (libevhtp) bind `ipv6:::1` and take a bare `::1` for IPv4; its
    gRPC server listens on `[::1]:PORT` and fails to start on `::1:PORT`."""
    from clients.tritonserver import server_command
    from supervisor.admin_access import AdminAccess

    def addresses(host, http_host=None):
        cmd = server_command("repo", 1, 2, 3, AdminAccess("k"), binary="tritonserver", backend_directory="b",
                             host=host, http_host=http_host)
        return [cmd[cmd.index(flag) + 1] for flag in ("--http-address", "--grpc-address", "--metrics-address")]
    assert addresses("::1") == ["ipv6:::1", "[::1]", "ipv6:::1"]
    assert addresses("::", http_host="127.0.0.1") == ["127.0.0.1", "[::]", "ipv6:::"]     # behind the guard
    assert addresses("0.0.0.0") == ["0.0.0.0", "0.0.0.0", "0.0.0.0"]


def test_off_loopback_serve_warns_that_tritons_inference_apis_take_no_key():
    """Issue 49, finding 13: `HOST=0.0.0.0` without a key warned only about the OpenAI API.
    Off loopback `serve` now says that Triton's own inference APIs take no key, and
    without the supervisor that no guard covers Triton's HTTP port; on loopback, nothing."""
    from clients.tritonserver import exposure_warnings, guard_enabled
    assert exposure_warnings("127.0.0.1", False, guard_enabled("auto", "127.0.0.1")) == []
    assert exposure_warnings("localhost", True, guard_enabled("auto", "localhost")) == []
    (exposed,) = exposure_warnings("0.0.0.0", False, guard_enabled("auto", "0.0.0.0"))
    assert "Triton's inference APIs" in exposed and "take no key" in exposed
    exposed, unguarded = exposure_warnings("0.0.0.0", True, guard_enabled("auto", "0.0.0.0"))
    assert "no HTTP guard" in unguarded and "CVE-2025-23310" in unguarded


def test_serve_tells_the_backend_where_tritons_http_port_is(monkeypatch, tmp_path):
    """The backend asks that port whether its model is still ready (readiness.py): the IPC
    call it would use otherwise crashes Triton 24.10's stub at SIGTERM about half the time."""
    import clients.tritonserver as launcher
    from backend.triton_server.readiness import SERVER_HTTP_ENV
    assert launcher.SERVER_HTTP_ENV == SERVER_HTTP_ENV
    seen = {}

    def execve(path, cmd, env):
        seen["env"], seen["cmd"] = env, cmd
        raise SystemExit(0)
    monkeypatch.setattr(launcher.os, "execve", execve)
    monkeypatch.setenv("TRITON_ADMIN_KEY", "k" * 32)
    for host, want in (("127.0.0.1", "127.0.0.1:18000"), ("0.0.0.0", "127.0.0.1:18000"),
                       ("::1", "[::1]:18000"), ("[::1]", "[::1]:18000")):
        with pytest.raises(SystemExit):
            launcher.main(["serve", "--no-supervisor", "--tritonserver", "/bin/true", "--host", host,
                           "--http-port", "18000", "--model-repository", str(tmp_path)])
        assert seen["env"][SERVER_HTTP_ENV] == want, host
