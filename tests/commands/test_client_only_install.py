"""``pip install avest`` without extras: the client commands run, the server ones say
what to install.

A fresh virtual environment (no site packages of this one, which has pydantic)
gets ``pip install --no-deps .`` plus only the base dependencies (numpy,
grpcio, protobuf). The environment with the base dependencies is cached under
``.cache/`` keyed by ``pyproject.toml``; avest itself is installed anew each
run, from a copy of the sources (so the work tree gets no build output).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from avest.commands.cli import SERVER_COMMANDS
from avest.offline.trace import write_trace
from tests.support.server import ServerHandle
from tests.support.traces import REPO_ROOT, make_synthetic_trace

pytestmark = pytest.mark.slow

BASE_DEPENDENCIES = ["numpy", "grpcio", "protobuf"]
SOURCES = ["pyproject.toml", "README.md", "LICENSE", "service", "client", "wire"]


def _pip(venv: Path, *args: str) -> None:
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    key = hashlib.sha256((REPO_ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    venv = REPO_ROOT / ".cache" / f"client-only-venv-{key}"
    if not (venv / "ready").is_file():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        _pip(venv, *BASE_DEPENDENCIES)
        (venv / "ready").write_text("numpy grpcio protobuf\n")
    src = tmp_path_factory.mktemp("avest-src")
    for name in SOURCES:
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    _pip(venv, "--no-deps", "--force-reinstall", str(src))
    return venv


def avest(
    venv: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("AVEST_", "PYTHON"))}
    return subprocess.run(
        [str(venv / "bin" / "avest"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
        cwd=venv,
    )


def test_the_environment_is_client_only(client_venv: Path) -> None:
    python = str(client_venv / "bin" / "python")
    for module in ("pydantic", "fastapi", "uvicorn", "tqdm"):
        probe = subprocess.run(
            [python, "-c", f"import {module}"], capture_output=True, cwd=client_venv
        )
        assert probe.returncode != 0, f"{module} is installed"
    # Run in the venv, so the checkout's own avest.egg-info (in the tests' working
    # directory) is not what is read; the fields, not Message.as_string(), which refuses
    # a description with a line like "AVEST_ADDRESS=avest:50051" as an embedded header.
    meta = subprocess.run(
        [
            python,
            "-c",
            "import json; from importlib.metadata import metadata; m = metadata('avest'); "
            "print(json.dumps([m['License-Expression'], m.get_all('License-File')]))",
        ],
        capture_output=True,
        text=True,
        cwd=client_venv,
    )
    assert meta.returncode == 0, meta.stderr
    assert json.loads(meta.stdout) == ["Apache-2.0", ["LICENSE"]]


def test_help_lists_every_command(client_venv: Path) -> None:
    proc = avest(client_venv, "--help", env={"COLUMNS": "300"})  # one line per command
    assert proc.returncode == 0, proc.stderr
    for name in ("serve", "pairs", "replay", "health", "record"):
        assert name in proc.stdout
    # Beside every command that needs it, with the install that works from a checkout.
    listing = [line.split() for line in proc.stdout.splitlines() if line.startswith("    ")]
    marked = [words[0] for words in listing if "[server" in words[1:2]]
    assert marked == list(SERVER_COMMANDS), proc.stdout
    assert "pip install -e '.[server]'" in proc.stdout and "avest[server]" not in proc.stdout
    assert avest(client_venv, "pairs", "--help").returncode == 0


def test_client_commands_against_a_live_server(
    client_venv: Path, server: ServerHandle, tmp_path: Path
) -> None:
    trace = tmp_path / "small.npz"
    write_trace(trace, make_synthetic_trace(steps=10, requests=4, k=3))
    env = {"AVEST_GRPC_ADDRESS": server.grpc_address}
    replayed = avest(client_venv, "replay", str(trace), "--json", env=env)
    assert replayed.returncode == 0, replayed.stderr
    pair_id = json.loads(replayed.stdout)["pair_id"]
    listed = avest(client_venv, "pairs", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    assert [p["pair_id"] for p in json.loads(listed.stdout)] == [pair_id]
    http = server.http_url.removeprefix("http://")
    health = avest(client_venv, "health", "--http-address", http)
    assert health.returncode == 0, health.stderr
    assert '"status":"ok"' in health.stdout.replace(" ", "")


def test_traces_merge_runs_on_numpy_alone(client_venv: Path, tmp_path: Path) -> None:
    """A mixed trace is made without the server extra (``evaluate --strata`` needs it)."""
    paths = []
    for seed in (0, 1):
        paths.append(str(tmp_path / f"t{seed}.npz"))
        write_trace(paths[-1], make_synthetic_trace(steps=10, requests=4, k=3, seed=seed))
    out = tmp_path / "mixed.npz"
    argv = ["traces", "merge", str(out), *paths, "--label", "a", "--label", "b"]
    proc = avest(client_venv, *argv)
    assert proc.returncode == 0, proc.stderr
    assert "a 40, b 40" in proc.stdout and out.is_file()


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["serve", "--grpc-address", "127.0.0.1:0"],
        ["demo"],
        ["evaluate"],
        ["simulate", "--json"],
    ],
)
def test_server_commands_name_the_extra(client_venv: Path, argv: list[str]) -> None:
    proc = avest(client_venv, *argv)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1
    # avest is not on PyPI: the hint is the install from a checkout.
    assert "pip install -e '.[server]'" in proc.stderr
    assert "avest[server]" not in proc.stderr
