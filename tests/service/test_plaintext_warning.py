"""A listener beyond loopback without TLS is warned of at start: its bearer tokens
travel in plaintext, or (``--insecure`` with no worker token) anyone may write.
Real servers, the warning read from the log (in process) and from ``avest serve``'s
output."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve import serve
from tests.support.server import launch

WORKER = "worker-secret"


def _start_warnings(data: Path, caplog: pytest.LogCaptureFixture, **settings: Any) -> list[str]:
    """The WARNING lines of a server's start on ``data`` under ``settings``."""
    caplog.set_level(logging.INFO, logger="avest")
    caplog.clear()
    srv = launch(data, **settings)
    try:
        assert srv.server.exposure == [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and "without TLS" in r.getMessage()
        ]
        return list(srv.server.exposure)
    finally:
        srv.stop()


def test_a_token_on_a_public_grpc_listener_without_tls_is_warned(tmp_path, caplog):
    said = _start_warnings(tmp_path, caplog, grpc_address="0.0.0.0:0", worker_token=WORKER)
    assert len(said) == 1, said
    assert said[0].startswith("gRPC listens on 0.0.0.0:0 without TLS")
    assert "--worker-token and --admin-token travel in plaintext" in said[0]
    assert "--tls-cert and --tls-key" in said[0]
    assert WORKER not in said[0]


def test_a_public_http_listener_without_tls_is_warned(tmp_path, caplog):
    # The test servers' admin token alone travels in plaintext on the admin API.
    said = _start_warnings(tmp_path, caplog, http_address="0.0.0.0:0", insecure=True)
    assert len(said) == 1, said
    assert said[0].startswith("admin HTTP listens on 0.0.0.0:0 without TLS")
    assert "--admin-token travel in plaintext" in said[0]


def test_insecure_with_no_token_is_warned(tmp_path, caplog):
    said = _start_warnings(
        tmp_path, caplog, grpc_address="0.0.0.0:0", insecure=True, admin_token=""
    )
    assert len(said) == 1, said
    assert "by --insecure, without a worker token: anyone who reaches it can write" in said[0]
    assert "--worker-token (AVEST_WORKER_TOKEN) with --tls-cert and --tls-key" in said[0]


def test_loopback_or_tls_is_not_warned(tmp_path, caplog, pki):
    assert _start_warnings(tmp_path / "a", caplog, worker_token=WORKER) == []
    tls = {"tls_cert": str(pki / "server.crt"), "tls_key": str(pki / "server.key")}
    assert (
        _start_warnings(
            tmp_path / "b", caplog, grpc_address="0.0.0.0:0", worker_token=WORKER, **tls
        )
        == []
    )


def test_avest_serve_warns_on_its_output(tmp_path):
    served = serve(tmp_path / "data", "--worker-token", WORKER, grpc_address="0.0.0.0:0")
    try:
        out = served.output()
    finally:
        served.stop()
    lines = [line for line in out.splitlines() if "travel in plaintext" in line]
    assert len(lines) == 1, out[-3000:]
    assert "WARNING" in lines[0] and "gRPC listens on 0.0.0.0:0 without TLS" in lines[0]


def test_a_public_read_port_is_warned_and_refused_without_a_token(tmp_path, caplog):
    said = _start_warnings(
        tmp_path, caplog, read_address="0.0.0.0:0", worker_token=WORKER, admin_token=""
    )
    assert len(said) == 1, said
    assert said[0].startswith("read port listens on 0.0.0.0:0 without TLS")
    assert "--worker-token travel in plaintext" in said[0]
    said = _start_warnings(
        tmp_path, caplog, read_address="0.0.0.0:0", insecure=True, admin_token=""
    )
    assert len(said) == 1, said
    assert "anyone who reaches it can read every pair" in said[0]
    with pytest.raises(PermissionError, match=r"read_address 0\.0\.0\.0:0 is reachable"):
        launch(tmp_path, read_address="0.0.0.0:0", worker_token="", insecure=False)
