"""``bench/loop_latency.py`` at its smallest: each server shape serves its streams and
the unary probe (and, beside the grpc.aio shapes, the read port's server answers it), and the report's figures are measured, not missing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import loop_latency  # noqa: E402

pytestmark = pytest.mark.slow


def test_every_shape_reports_acks_and_probes(capsys: pytest.CaptureFixture[str]) -> None:
    loop_latency.main(["--streams", "8", "--seconds", "6", "--settle", "1", "--procs", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["server"] for r in rows] == ["aio", "aio-gated", "aio-thread", "aio-process", "sync"]
    for r in rows:
        assert r["streams"] == 8 and r["acked_per_s"] > 0
        assert r["unary_calls"] >= 5 and 0 < r["unary_p50_ms"] <= r["unary_p99_ms"]
        assert 0 <= r["stream_first_ack_p50_s"] <= r["stream_first_ack_max_s"]
    assert all("loop_lag_p50_ms" in r for r in rows[:4])
    # beside each grpc.aio shape, the read port's synchronous server answers the probe too
    for r in rows[:4]:
        assert r["read_unary_calls"] == r["unary_calls"]
        assert 0 < r["read_unary_p50_ms"] <= r["read_unary_p99_ms"]
    assert "read_unary_calls" not in rows[4]
