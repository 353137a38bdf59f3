"""What the commands promise a newcomer, against a real service: strict JSON from every
``--json``, tokens from a flag, a file or the environment, duplicates counted by
``avest replay``, ``avest serving`` said once, and K refused unless an integer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from avest.commands.cli import build_parser, main
from avest.offline.trace import write_trace
from avest_client import EstimatorClient
from avest_client.errors import InvalidArgumentError
from tests.support.serve import serve
from tests.support.server import ServerHandle
from tests.support.traces import make_synthetic_trace

pytestmark = pytest.mark.slow


def strict(text: str) -> Any:
    """``json.loads`` refusing the NaN and Infinity Python's own parser lets through."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.npz"
    write_trace(path, make_synthetic_trace(steps=12, requests=4, k=3))
    return path


def json_commands() -> set[str]:
    """Every subcommand with a ``--json`` flag, read off the parsers."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name
        for name, parser in sub.choices.items()
        if any("--json" in a.option_strings for a in parser._actions)
    }


def test_every_json_output_is_strict_json(
    server: ServerHandle, tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A pair registered and never fed: its calibration is NaN, which `pairs --json`
    # wrote bare before.
    with EstimatorClient(server.grpc_address) as client:
        client.register("t", "d", "draft_model", 3)
    address = ["--address", server.grpc_address]
    runs = {
        "pairs": ["pairs", *address],
        "replay": ["replay", str(tiny), *address],
        "evaluate": ["evaluate", str(tiny), "--refit-interval", "4"],
        "fleet": [
            "fleet",
            str(tiny),
            "--workers",
            "1",
            "--restart-every",
            "0",
            "--steps",
            "20",
        ],
        "simulate": ["simulate", str(tiny), "--concurrency", "2", "--min-steps", "0"],
        "audit": ["audit", "--trials", "200"],
    }
    assert set(runs) == json_commands()
    for name, argv in runs.items():
        code = main([*argv, "--json"])
        out = capsys.readouterr().out
        assert code in (0, 1), (name, code)  # audit exits 1 when a rule is biased
        strict(out)
    pairs = strict((main(["pairs", *address, "--json"]), capsys.readouterr().out)[1])
    idle = next(p for p in pairs if p["key"]["target"] == "t")
    assert idle["calibration"]["auc"] is None  # null, never NaN


def test_tokens_from_flag_file_and_environment(
    tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    for name in ("AVEST_TOKEN", "AVEST_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with serve(tmp_path / "data", "--worker-token", "w0rker", "--admin-token", "adm1n") as s:
        # One announcement (the service's log line said it again before).
        assert s.output().count("avest serving") == 1, s.output()
        address = ["--address", s.grpc_address]
        assert main(["pairs", *address]) == 1
        err = capsys.readouterr().err
        assert "UNAUTHENTICATED" in err and len(err.splitlines()) == 1
        assert "--token" in err and "AVEST_TOKEN" in err  # how to pass one
        assert main(["pairs", *address, "--token", "wrong"]) == 1
        assert "unknown token" in capsys.readouterr().err
        assert main(["pairs", *address, "--token", "w0rker"]) == 0
        secret = tmp_path / "token"
        secret.write_text("w0rker\n")  # a mounted secret ends with a newline
        assert main(["pairs", *address, "--token-file", str(secret)]) == 0
        assert main(["replay", str(tiny), *address, "--token-file", str(secret)]) == 0
        capsys.readouterr()
        assert main(["pairs", *address, "--token-file", str(tmp_path / "none")]) == 2
        assert "--token-file" in capsys.readouterr().err
        monkeypatch.setenv("AVEST_ADMIN_TOKEN", "adm1n")  # the admin token does a worker's
        assert main(["pairs", *address, "--json"]) == 0
        assert len(strict(capsys.readouterr().out)) == 1
        monkeypatch.setenv("AVEST_TOKEN", "w0rker")
        monkeypatch.delenv("AVEST_ADMIN_TOKEN")
        assert main(["pairs", *address]) == 0
        capsys.readouterr()
        # An admin action without the admin token: the worker's is not enough.
        pair = strict((main(["pairs", *address, "--json"]), capsys.readouterr().out)[1])[0]
        argv = ["record", pair["pair_id"], str(tmp_path / "out.npz"), "--http", s.http_url]
        assert main([*argv, "--steps", "1", "--timeout", "0.1"]) == 1
        assert "admin token" in capsys.readouterr().err


def test_replaying_acknowledged_data_says_so(
    server: ServerHandle, tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", str(tiny), "--address", server.grpc_address]
    assert main([*argv, "--json"]) == 0
    first = strict(capsys.readouterr().out)
    assert first["new"] == first["messages"] == 12 and first["duplicates"] == 0
    assert main([*argv, "--json"]) == 0
    again = strict(capsys.readouterr().out)
    assert again["messages"] == 12 and again["new"] == 0 and again["duplicates"] == 12
    assert again["steps_observed"] == first["steps_observed"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "0 new, 12 duplicates" in out and "--run-id" in out
    assert main([*argv, "--run-id", "again", "--json"]) == 0  # new workers: counted
    assert strict(capsys.readouterr().out)["new"] == 12
    assert main([*argv, "--run-id", "two", "--workers", "2", "--json"]) == 0
    two = strict(capsys.readouterr().out)
    assert two["new"] == two["messages"] > 12 and two["duplicates"] == 0


@pytest.mark.parametrize("k", [2.5, 2.0, "3"])
def test_register_refuses_a_k_that_is_not_an_integer(server: ServerHandle, k: Any) -> None:
    with EstimatorClient(server.grpc_address) as client:
        with pytest.raises(InvalidArgumentError, match=r"k \(num_speculative_tokens\) must be"):
            client.register("t", "d", "draft_model", k)
        assert client.pairs() == []
