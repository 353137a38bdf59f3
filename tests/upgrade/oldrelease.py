"""The first release (0.1.0, commit 1cba659) in a venv of its own, run as subprocesses.

``old_venv()`` returns the venv (``AVEST_OLD_RELEASE_VENV`` or ``<repo>/.venv-0.1.0``),
creating it with ``scripts/old-release`` when absent (``scripts/check`` does that
first). ``OldServer`` runs that release's ``avest serve`` (:func:`tests.support.serve.serve`); ``run_old`` runs a Python
script with that release's packages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve import serve

REPO = Path(__file__).resolve().parents[2]
RELEASE = "0.1.0"


def old_venv() -> Path:
    venv = Path(os.environ.get("AVEST_OLD_RELEASE_VENV", REPO / f".venv-{RELEASE}"))
    python = venv / "bin" / "python"
    if not python.exists():
        done = subprocess.run(
            [str(REPO / "scripts" / "old-release")],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable, "AVEST_OLD_RELEASE_VENV": str(venv)},
            timeout=900,
        )
        if done.returncode != 0:
            pytest.fail(f"could not install avest {RELEASE}: {done.stderr[-2000:]}")
    return venv


def _clean_env() -> dict[str, str]:
    """The environment without this checkout on PYTHONPATH (the old venv imports its own)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_old(script: str, *args: str, timeout: float = 120) -> Any:
    """Run ``script`` with the old release's Python; its stdout's last line as JSON."""
    done = subprocess.run(
        [str(old_venv() / "bin" / "python"), "-c", script, *args],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


class OldServer:
    """``avest serve`` of the old release on 127.0.0.1 free ports, over ``data_dir``."""

    def __init__(self, data_dir: Path, *extra: str) -> None:
        self.log = data_dir.parent / f"old-server-{time.monotonic_ns()}.log"
        self.served = serve(
            data_dir,
            *("--flush-interval-ms", "20", *extra),
            command=[str(old_venv() / "bin" / "avest")],
            env=_clean_env(),
            log=self.log,
        )
        self.proc = self.served.proc
        self.grpc_address, self.http_url = self.served.grpc_address, self.served.http_url

    def version(self) -> str:
        return str(run_old("import avest, json; print(json.dumps(avest.__version__))", timeout=30))

    def stop(self) -> int:
        return self.served.stop(30.0)

    def __enter__(self) -> OldServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
