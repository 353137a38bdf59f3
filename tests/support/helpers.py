"""Small helpers the tests share: free loopback ports, polling, loopback HTTP, tools,
float32 rounding, and skipping for a missing vLLM environment."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def hold_loop(handle: Any, seconds: float = 60.0) -> threading.Event:
    """Block a served handle's event loop until the returned event is set (or
    ``seconds`` pass); returns once the loop is blocked."""
    blocked, release = threading.Event(), threading.Event()

    def hold() -> None:
        blocked.set()
        release.wait(seconds)

    handle.loop.call_soon_threadsafe(hold)
    assert blocked.wait(10), "the service loop never ran the blocking callback"
    return release


@contextlib.contextmanager
def held_loop(handle: Any) -> Iterator[None]:
    """The handle's event loop held (nothing on it runs) for the block."""
    release = hold_loop(handle)
    try:
        yield
    finally:
        release.set()


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``pred`` until it holds or ``timeout`` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def http_get(url: str, timeout: float = 5.0) -> bytes:
    """The body of a GET on a loopback URL (an HTTP error status raises)."""
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
        return bytes(resp.read())


def find_tool(name: str) -> str | None:
    """``name`` on PATH, or next to this Python (a venv's bin is often not on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def f32(x: float) -> float:
    """``x`` as a float32 tensor holds it."""
    return float(np.float32(x))


def missing_environment(reason: str, log: Path) -> NoReturn:
    """Skip a test whose environment (a vLLM build) is absent, with the end of ``log``
    (the build's output) in the reason; fail it instead under CI or with
    ``AVEST_REQUIRE_VLLM_ENV=1``, where the environment must be there."""
    if log.exists():
        reason += f"\n.cache/{log.name} ends:\n" + log.read_text()[-3000:]
    if os.environ.get("CI") or os.environ.get("AVEST_REQUIRE_VLLM_ENV") == "1":
        pytest.fail(reason)
    pytest.skip(reason)
