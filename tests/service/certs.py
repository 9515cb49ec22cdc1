"""Throwaway PEM certificates for TLS tests, made at test time (``cryptography`` if installed, else
the ``openssl`` command line)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def _run(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certs(root: Path) -> dict[str, Path]:
    """CA, a server cert for localhost/127.0.0.1 and a client cert, all signed by the CA."""
    if shutil.which("openssl") is None:
        import pytest
        pytest.skip("openssl is not installed")
    root.mkdir(parents=True, exist_ok=True)
    _run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
         "-days", "2", "-subj", "/CN=mixrl-test-ca", cwd=root)
    (root / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    (root / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN=mixrl-{name}", cwd=root)
        _run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=root)
    return {k: root / v for k, v in {"ca": "ca.pem", "server_cert": "server.pem", "server_key": "server.key",
                                      "client_cert": "client.pem", "client_key": "client.key"}.items()}
