"""``avest replay`` and ``avest pairs`` against a real service on 127.0.0.1:0."""

from __future__ import annotations

import json

from avest.commands.cli import main
from avest.core.rules import VllmRule
from avest.offline.trace import write_trace
from commands.test_cli import replay_core


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
