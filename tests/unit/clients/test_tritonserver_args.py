"""What `serve` tells the OpenAI frontend about Triton's gRPC TLS (clients/tritonserver.py)."""

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
