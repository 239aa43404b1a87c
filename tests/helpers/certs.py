"""A self-signed TLS certificate for 127.0.0.1, made with the openssl command."""

import shutil
import subprocess

import pytest


def self_signed(folder) -> tuple[str, str]:
    """(certificate, key) files in `folder`; skips the test where openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = str(folder / "cert.pem"), str(folder / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True)
    return cert, key
