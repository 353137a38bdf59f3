"""``avest replay`` and ``avest pairs`` against a real service on 127.0.0.1:0."""

from __future__ import annotations

import dataclasses
import json

import pytest

from avest.commands.cli import main
from avest.core.rules import VllmRule
from avest.offline.trace import write_trace
from tests.support.traces import replay_core

pytestmark = pytest.mark.slow


def test_replay_and_pairs_against_a_real_service(server, trace_slice, tmp_path, capsys):
    path = tmp_path / "t.npz"
    trace = trace_slice("chat", 0, 60)
    write_trace(path, trace)
    args = ["replay", str(path), "--address", server.grpc_address, "--rule", "vllm"]
    assert main([*args, "--refit-interval", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    core = replay_core(trace, VllmRule(), 20)
    assert out["messages"] == 60 and out["version"] == 3
    assert out["slope"] == core.coefficients.slope
    assert out["drafts_observed"] == core.drafts
    assert main(["pairs", "--address", server.grpc_address, "--json"]) == 0
    pairs = json.loads(capsys.readouterr().out)
    assert [p["pair_id"] for p in pairs] == [out["pair_id"]]


def test_replay_resumes_after_a_crash_and_a_rerun_counts_nothing_twice(tmp_path, trace_slice):
    import asyncio
    import signal
    import socket
    import threading
    import time

    from avest.offline.replay import replay
    from tests.support.serve import spawn

    trace = trace_slice("chat", 0, 400)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    args = ("--grpc-address", address, "--refit-interval", "25", "--flush-interval-ms", "50")
    proc, _ = spawn(tmp_path, *args)
    sent = 0
    crashed = threading.Event()

    def count() -> None:
        nonlocal sent
        sent += 1
        if sent == 300 and not crashed.is_set():
            proc.send_signal(signal.SIGKILL)  # mid-replay, acks in flight lost
            crashed.set()

    results = []
    errors = []

    def run() -> None:
        try:
            results.append(
                asyncio.run(replay(address, trace, workers=2, on_message=count, rate=400))
            )
        except Exception as exc:  # surfaced below
            errors.append(exc)

    runner = threading.Thread(target=run)
    runner.start()
    try:
        assert crashed.wait(60)
        proc.wait(10)
        time.sleep(0.5)
        proc, _ = spawn(tmp_path, *args)  # the service comes back on the same address
        runner.join(120)
        assert not errors, errors
        first = results[0]
        core = replay_core(trace, VllmRule(), 25)
        # Everything counted exactly once despite the crash.
        assert first.acked == first.messages == 800
        assert first.pair.steps_observed == 800
        assert first.pair.drafts_observed == core.drafts
        # Run again (after a crash of the replay itself, say): nothing counted twice.
        again = asyncio.run(replay(address, trace, workers=2))
        assert again.acked == 800 and again.pair.drafts_observed == core.drafts
        assert again.pair.steps_observed == 800
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_replay_registers_the_pair_under_each_named_update_rule(server, trace_slice, tmp_path,
                                                                 capsys):  # fmt: skip
    """Every rule `avest replay --rule` offers reaches the service (the names and enum
    values come from one table, avest_wire.rules)."""
    path = tmp_path / "t.npz"
    for i, rule in enumerate(("tracking", "vllm", "recursive")):
        trace = trace_slice("chat", 0, 12)
        write_trace(path, dataclasses.replace(trace, meta={**trace.meta, "target": rule}))
        args = ["replay", str(path), "--address", server.grpc_address, "--rule", rule, "--json"]
        assert main(args) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["messages"] == 12, (i, out)
        assert main(["pairs", "--address", server.grpc_address, "--json"]) == 0
        pairs = {p["pair_id"]: p for p in json.loads(capsys.readouterr().out)}
        assert pairs[out["pair_id"]]["rule"] == rule
