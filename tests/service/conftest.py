"""Fixtures of the service tests (the shared ones are in :mod:`tests.support.fixtures`).

- ``pki``: a directory with a throwaway CA (``ca.crt``) and a server and a client
  certificate signed by it (``server.crt``/``.key`` for 127.0.0.1 and localhost,
  ``client.crt``/``.key`` for client auth), valid for two days.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to make test certificates")
    d = tmp_path / "pki"
    d.mkdir()
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=avest-test-ca",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"),
    )  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
            "-keyout", str(d / f"{name}.key"), "-out", str(d / f"{name}.csr"),
        )  # fmt: skip
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.crt"),
            "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2",
            "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.crt"),
        )  # fmt: skip
    return d
