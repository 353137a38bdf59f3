"""Helpers shared by the client tests (imported as ``client_support``)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from avest.core.estimator import OnlineEstimator
from avest.core.rule_factory import make_rule, rule_options
from avest.settings import Settings

Step = tuple[np.ndarray, np.ndarray, np.ndarray]


def trace_steps(trace: Any) -> list[Step]:
    """``(features, num_verified, num_accepted)`` per decode step of a trace."""
    return [(s.features, s.num_verified, s.num_accepted) for s in trace.steps()]


def core_replay(
    steps: list[Step], k: int, rule: str, refit_interval: int, settings: Settings
) -> OnlineEstimator:
    """The in-process estimator the service builds for a pair, fed the same steps."""
    est = OnlineEstimator(
        k,
        make_rule(rule, **rule_options(rule, settings.forgetting, settings.prior)),
        refit_interval=refit_interval,
        calibrate=True,
    )
    for x, d, a in steps:
        est.observe(x, d, a)
    return est


def free_port() -> int:
    """A port nothing listens on (bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def serve_subprocess(data_dir: str | Path, port: int = 0) -> tuple[subprocess.Popen[str], str]:
    """``avest serve`` in a subprocess; ``(process, grpc address)`` once it serves."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from avest.commands.cli import main; sys.exit(main())",
            "serve",
            "--grpc-address",
            f"127.0.0.1:{port}",
            "--http-address",
            "127.0.0.1:0",
            "--data-dir",
            str(data_dir),
            "--flush-interval-ms",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"avest serving grpc=(\S+)", line)
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("server did not start")
