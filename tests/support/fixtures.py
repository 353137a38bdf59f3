"""The shared pytest fixtures (a plugin: ``tests/conftest.py`` loads it).

Traces:

- ``trace_slice(name="sample", start=0, stop=None)`` -> :class:`avest.offline.trace.Trace`:
  decode steps ``[start, stop)`` of a named trace (:func:`tests.support.traces.load_trace`).
- ``sample_trace``: the bundled sample, whole.
- ``make_synthetic_trace(...)``: :func:`tests.support.traces.make_synthetic_trace`.

In-process servers (:mod:`tests.support.server`):

- ``server``: a started server with ``flush_interval_ms=20`` and a fresh data
  directory; stopped cleanly at teardown.
- ``start_server(data_dir, **overrides)``: a factory for restart tests; every server it
  starts is stopped at teardown unless the test stopped it.
- ``open_server(**settings)`` / ``live``: the same with a gRPC stub and an HTTP client
  (:mod:`tests.support.live`), on one data directory per test.

A subprocess service (:mod:`tests.support.serve`):

- ``subprocess_server``: ``avest serve`` flushing every 20 ms; its gRPC address.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from avest.offline.trace import Trace
from tests.support.live import LIVE_SETTINGS, Live
from tests.support.serve import serve
from tests.support.server import ServerHandle, launch
from tests.support.traces import load_trace, make_synthetic_trace


@pytest.fixture
def trace_slice() -> Callable[..., Trace]:
    def get(name: str = "sample", start: int | None = 0, stop: int | None = None) -> Trace:
        return load_trace(name).slice_steps(start, stop)

    return get


@pytest.fixture
def sample_trace() -> Trace:
    return load_trace("sample")


@pytest.fixture(name="make_synthetic_trace")
def make_synthetic_trace_fixture() -> Callable[..., Trace]:
    return make_synthetic_trace


@pytest.fixture
def start_server() -> Iterator[Callable[..., ServerHandle]]:
    started: list[ServerHandle] = []

    def start(data_dir: str | Path, **overrides: Any) -> ServerHandle:
        handle = launch(data_dir, **overrides)
        started.append(handle)
        return handle

    yield start
    errors = []
    for handle in reversed(started):
        try:
            handle.stop()
        except Exception as exc:  # stop the others anyway
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerHandle]:
    handle = launch(tmp_path / "data")
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def open_server(
    start_server: Callable[..., ServerHandle], tmp_path: Path
) -> Iterator[Callable[..., Live]]:
    """``open_server(**settings)``: a live server on free ports, on one data directory
    (so a second call after ``stop()`` restarts on the same state)."""
    opened: list[Live] = []

    def open_(**overrides: Any) -> Live:
        live = Live(start_server(tmp_path / "data", **{**LIVE_SETTINGS, **overrides}))
        opened.append(live)
        return live

    yield open_
    for live in opened:
        live.close()


@pytest.fixture
def live(open_server: Callable[..., Live]) -> Live:
    return open_server()


@pytest.fixture
def subprocess_server(tmp_path: Path) -> Iterator[str]:
    """``avest serve`` in a subprocess (flush every 20 ms); yields its gRPC address."""
    with serve(tmp_path / "subprocess-data", "--flush-interval-ms", "20") as served:
        yield served.grpc_address
