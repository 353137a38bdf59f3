"""``avest health`` (the image's HEALTHCHECK): healthy against a live service with
and without TLS, mutual TLS included; unhealthy against a dead port."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from avest.commands.cli import main

ENV = ("AVEST_HTTP_ADDRESS", "AVEST_TLS_CERT", "AVEST_TLS_KEY", "AVEST_TLS_CLIENT_CA")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (*ENV, "AVEST_HEALTH_CERT", "AVEST_HEALTH_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _wildcard(http_url: str) -> str:
    """The address as a container's AVEST_HTTP_ADDRESS names it: a wildcard bind."""
    return "0.0.0.0:" + http_url.rpartition(":")[2]


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_plain_http(start_server, tmp_path, env, capsys) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data")
    env.setenv("AVEST_HTTP_ADDRESS", _wildcard(handle.http_url))
    assert main(["health"]) == 0
    assert main(["health", "--ready"]) == 0
    env.setenv("AVEST_HTTP_ADDRESS", f"0.0.0.0:{_dead_port()}")
    assert main(["health"]) == 1
    assert "/healthz" in capsys.readouterr().err


def test_tls_on(start_server, tmp_path, env, pki: Path) -> None:  # noqa: ANN001, F811
    tls = {"AVEST_TLS_CERT": str(pki / "server.crt"), "AVEST_TLS_KEY": str(pki / "server.key")}
    handle = start_server(
        tmp_path / "data", tls_cert=tls["AVEST_TLS_CERT"], tls_key=tls["AVEST_TLS_KEY"]
    )
    address = _wildcard(handle.http_url)
    for name, value in tls.items():
        env.setenv(name, value)
    env.setenv("AVEST_HTTP_ADDRESS", address)
    assert main(["health"]) == 0
    # Verifying the service's certificate too, when given its CA.
    assert (
        main(
            [
                "health",
                "--ca",
                str(pki / "ca.crt"),
                "--http-address",
                f"localhost:{address.rpartition(':')[2]}",
            ]
        )
        == 0
    )
    # A plain-HTTP probe (what the image ran before) gets no answer from a TLS port.
    for name in tls:
        env.delenv(name)
    assert main(["health"]) == 1


def test_mutual_tls(start_server, tmp_path, env, pki: Path) -> None:  # noqa: ANN001, F811
    handle = start_server(
        tmp_path / "data",
        tls_cert=str(pki / "server.crt"),
        tls_key=str(pki / "server.key"),
        tls_client_ca=str(pki / "ca.crt"),
    )
    env.setenv("AVEST_HTTP_ADDRESS", _wildcard(handle.http_url))
    env.setenv("AVEST_TLS_CERT", str(pki / "server.crt"))
    env.setenv("AVEST_TLS_KEY", str(pki / "server.key"))
    env.setenv("AVEST_TLS_CLIENT_CA", str(pki / "ca.crt"))
    # By default the service's own certificate (same CA) is the client certificate.
    assert main(["health"]) == 0
    # A client certificate of its own.
    env.setenv("AVEST_HEALTH_CERT", str(pki / "client.crt"))
    env.setenv("AVEST_HEALTH_KEY", str(pki / "client.key"))
    assert main(["health"]) == 0
    # A certificate the client CA did not sign is refused by the service.
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=stranger", "-keyout", str(other / "k"), "-out", str(other / "c")],
        check=True, capture_output=True,
    )  # fmt: skip
    env.setenv("AVEST_HEALTH_CERT", str(other / "c"))
    env.setenv("AVEST_HEALTH_KEY", str(other / "k"))
    assert main(["health"]) == 1


def test_the_command_runs_as_the_image_runs_it(start_server, tmp_path) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data")
    import os

    env = dict(os.environ, AVEST_HTTP_ADDRESS=_wildcard(handle.http_url))
    code = "import sys; from avest.commands.cli import main; sys.exit(main())"
    r = subprocess.run(
        [sys.executable, "-c", code, "health"], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
