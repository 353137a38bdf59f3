"""The admin HTTP server on its own thread: /healthz reads the event loop's heartbeat.

A probe must not wait behind a saturated service loop (an overloaded service is
alive), and must fail once the loop stops turning (a wedged one is not); every
other route still runs on the loop that owns the state.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import avest
from avest.metrics.names import LOOP_LAG
from tests.support.helpers import hold_loop


def test_healthz_answers_while_the_loop_is_busy_and_readyz_waits_for_it(
    start_server: Callable[..., Any], tmp_path
) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data")
    url = handle.http_url
    assert httpx.get(url + "/readyz", timeout=10).status_code == 200
    release = hold_loop(handle)
    try:
        r = httpx.get(url + "/healthz", timeout=10)
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "version": avest.__version__}
        # Readiness reads the state, on the loop: it waits until the loop turns again.
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(url + "/readyz", timeout=1.0)
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.TimeoutException:
            pass
    else:
        pytest.fail("/readyz never answered once the loop turned again")


def test_healthz_is_503_while_the_loop_does_not_turn(
    start_server: Callable[..., Any], tmp_path
) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data")
    url = handle.http_url
    handle.server.heartbeat.stale_after_s = 0.5
    release = hold_loop(handle)
    try:
        time.sleep(1.0)
        r = httpx.get(url + "/healthz", timeout=10)
        assert r.status_code == 503
        body = r.json()
        assert body["status"] == "unresponsive"
        assert "event loop has not turned for" in body["reason"]
    finally:
        release.set()
    # Healthy again once the loop runs its heartbeat.
    deadline = time.monotonic() + 30
    while httpx.get(url + "/healthz", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "/healthz stayed 503 after the loop turned again"
        time.sleep(0.1)


def test_a_client_that_leaves_mid_request_leaves_the_api_serving(
    start_server: Callable[..., Any], tmp_path
) -> None:  # noqa: ANN001
    # The request is handed to the loop while the loop is held; the client gives
    # up; the handler's relay is cancelled, and the API still answers afterwards.
    handle = start_server(tmp_path / "data")
    url = handle.http_url
    release = hold_loop(handle)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(url + "/v1/pairs", timeout=0.5)
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while True:
        try:
            r = httpx.get(url + "/v1/pairs", timeout=2)
            break
        except httpx.TimeoutException:
            assert time.monotonic() < deadline
    assert r.status_code == 200 and r.json()["pairs"] == []


def test_admin_connections_send_small_writes_at_once(
    start_server: Callable[..., Any], tmp_path
) -> None:  # noqa: ANN001
    # uvicorn writes a response's head and body apart: with Nagle's algorithm on, the
    # body waited for the client's delayed ACK, 40 ms on every admin response.
    handle = start_server(tmp_path / "data")
    with httpx.Client(base_url=handle.http_url, timeout=10) as http:
        assert http.get("/healthz").status_code == 200
        connections = list(handle.server._http.server.server_state.connections)
        assert connections, "the request's keep-alive connection is not open"
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_a_held_loop_shows_in_its_lag_histogram(start_server: Callable[..., Any], tmp_path) -> None:  # noqa: ANN001
    handle = start_server(tmp_path / "data")

    def lag() -> tuple[float, float]:
        text = httpx.get(handle.http_url + "/metrics", timeout=10).text
        got = {}
        for line in text.splitlines():
            for part in ("_sum", "_count"):
                if line.startswith(f"{LOOP_LAG}{part} "):
                    got[part] = float(line.split()[1])
        return got["_sum"], got["_count"]

    before_sum, _ = lag()
    release = hold_loop(handle)
    time.sleep(1.5)
    release.set()
    deadline = time.monotonic() + 30
    while True:  # the beat that was due while the loop was held runs at least 1 s late
        total, count = lag()
        if total - before_sum >= 1.0:
            break
        assert time.monotonic() < deadline, (total, count)
        time.sleep(0.2)
    assert count >= 1
