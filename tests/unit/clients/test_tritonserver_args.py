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
