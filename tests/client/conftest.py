"""Client tests run against a real server: the fixtures of ``tests/service/conftest.py``.

That conftest is not visible from this folder, so it is loaded by path and
its fixtures re-exported. Helpers for the tests live here too.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .client_support import Step, serve_subprocess, trace_steps

_SERVICE_CONFTEST = Path(__file__).resolve().parent.parent / "service" / "conftest.py"
_spec = importlib.util.spec_from_file_location("avest_tests_service_conftest", _SERVICE_CONFTEST)
assert _spec is not None and _spec.loader is not None
service_conftest = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = service_conftest
_spec.loader.exec_module(service_conftest)

server = service_conftest.server
start_server = service_conftest.start_server
launch = service_conftest.launch
ServerHandle = service_conftest.ServerHandle


@pytest.fixture
def chat_steps(trace_slice: Callable[..., Any]) -> Callable[[int, int], tuple[int, list[Step]]]:
    """``(K, steps)`` of decode steps ``[start, stop)`` of the shared chat trace."""

    def get(start: int = 0, stop: int = 200) -> tuple[int, list[Step]]:
        trace = trace_slice("chat", start, stop)
        return trace.k, trace_steps(trace)

    return get


@pytest.fixture
def subprocess_server(tmp_path: Path) -> Iterator[str]:
    """``avest serve`` in a subprocess (flush every 20 ms); yields its gRPC address."""
    proc, address = serve_subprocess(tmp_path / "subprocess-data")
    try:
        yield address
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
