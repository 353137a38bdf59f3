"""The command line's rough edges on user paths, each against the real parts.

A busy port, no service to replay into, the service address from the
environment, the demo's temporary directory, ``simulate`` into a pipe, a
reader that goes away, the API reference offline, the package's license.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from avest.commands.cli import main
from avest.offline.trace import write_trace
from tests.support.traces import REPO_ROOT, make_synthetic_trace

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-c", "import sys; from avest.commands.cli import main; sys.exit(main())"]


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.npz"
    write_trace(path, make_synthetic_trace(steps=10, requests=4, k=3))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- avest serve on a busy port ----------------------------------------------------


@pytest.mark.parametrize("busy", ["--grpc-address", "--http-address"])
def test_serve_on_a_busy_port_says_so_in_one_line(busy: str, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        addresses = {
            "--grpc-address": "127.0.0.1:0",
            "--http-address": "127.0.0.1:0",
            busy: address,
        }
        argv = [*CLI, "serve", "--data-dir", str(tmp_path / "data")]
        for flag, value in addresses.items():
            argv += [flag, value]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Event loop is closed" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"avest serve: cannot listen on {address}")
    assert busy in last


# -- avest replay without a service ----------------------------------------------------


def test_replay_without_a_service_fails_fast_naming_the_address(small_trace, capsys) -> None:  # noqa: ANN001
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["replay", str(small_trace), "--address", address]) == 1
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert f"no service answers at {address}" in err and "avest serve" in err
    assert elapsed < 20  # the default wait is 5 s, not the 60 s of --retry-s


# -- AVEST_GRPC_ADDRESS ---------------------------------------------------------------


def test_pairs_and_replay_take_the_address_from_the_environment(
    server,
    small_trace,
    monkeypatch,
    capsys,  # noqa: ANN001
) -> None:
    # As the service reads it: a wildcard bind is reached on loopback.
    monkeypatch.setenv("AVEST_GRPC_ADDRESS", f"0.0.0.0:{server.grpc_port}")
    assert main(["replay", str(small_trace), "--json"]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert main(["pairs", "--json"]) == 0
    (pair,) = json.loads(capsys.readouterr().out)
    assert pair["pair_id"] == replayed["pair_id"] and pair["steps_observed"] == 10
    # A flag still wins over the environment.
    monkeypatch.setenv("AVEST_GRPC_ADDRESS", f"127.0.0.1:{free_port()}")
    assert main(["pairs", "--json", "--address", server.grpc_address]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 1


# -- avest demo's temporary directory ---------------------------------------------------


def demo(tmp_path: Path, *extra: str, sigint_ignored: bool = False) -> subprocess.Popen[str]:
    """``avest demo`` in a subprocess; ``sigint_ignored``: started as a shell's background
    job is, with SIGINT ignored (which asyncio alone would leave unhandled)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [*CLI, "demo", "--grpc-address", "127.0.0.1:0", "--http-address", "127.0.0.1:0"]
    return subprocess.Popen(
        [*argv, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if sigint_ignored
        else None,
    )


def test_demo_removes_its_temporary_directory(tmp_path: Path) -> None:
    proc = demo(tmp_path, "--exit")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "replayed" in out
    assert "avest-demo-" in out  # it did use one
    assert not list(tmp_path.glob("avest-demo-*"))


@pytest.mark.parametrize(
    ("sig", "sigint_ignored"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
)
def test_a_stopped_demo_removes_its_temporary_directory(
    sig: int, sigint_ignored: bool, tmp_path: Path
) -> None:
    proc = demo(tmp_path, "--workers", "1", sigint_ignored=sigint_ignored)
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith("serving"):
                break
        assert list(tmp_path.glob("avest-demo-*"))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("avest-demo-*"))


# -- avest simulate without a terminal --------------------------------------------------


def test_simulate_into_a_pipe_prints_a_summary(trace_slice, tmp_path, capsys) -> None:  # noqa: ANN001
    path = write_trace(tmp_path / "slice.npz", trace_slice("sample", 0, 20))
    argv = ["simulate", str(path), "--costs", "a100-llama8b,l40s-llama8b", "--concurrency", "4,8"]
    assert main([*argv, "--min-steps", "0"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert len(lines) < 15
    assert sum(line.split()[:1] == ["8"] for line in lines) == 2  # C=8, one per profile
    assert "avest/lossless-walk" in captured.out and "--table" in captured.out
    assert "simulate 2/2" in captured.err  # progress without a terminal
    # The whole table on request.
    assert main([*argv, "--min-steps", "0", "--table"]) == 0
    table = capsys.readouterr().out
    assert "best fixed length" in table and "avest/argmax *" in table
    assert len(table.splitlines()) > 3 * len(lines)


# -- a reader that goes away -------------------------------------------------------------


def test_pairs_into_a_closed_pipe_exits_quietly(server) -> None:  # noqa: ANN001
    proc = subprocess.Popen(
        [*CLI, "pairs", "--json", "--address", server.grpc_address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head` that has read enough, before anything is written
    err = proc.stderr.read()
    assert proc.wait(60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err


# -- /docs offline --------------------------------------------------------------------------


def test_the_api_reference_loads_nothing_from_elsewhere(server) -> None:  # noqa: ANN001
    r = httpx.get(f"{server.http_url}/docs", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    own = urlsplit(server.http_url).netloc
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)""", r.text)
    urls += re.findall(r"""url\(\s*["']?([^"')]+)""", r.text)
    external = [u for u in urls if urlsplit(u).scheme and urlsplit(u).netloc != own]
    assert not external
    assert "/v1/pairs/{pair_id}" in r.text and "/openapi.json" in r.text


# -- the license, in the form setuptools keeps accepting ----------------------------------


def test_the_license_is_an_spdx_expression() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert (REPO_ROOT / "LICENSE").is_file()
    # The SPDX string form needs setuptools 77 (PEP 639).
    assert "setuptools>=77" in pyproject["build-system"]["requires"]
