"""``bench/grpc_unary_wait.py`` at its smallest: both servers answer the probes, the
streams ack, and the report carries each one's quantiles (it fails loudly otherwise)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import grpc_unary_wait  # noqa: E402

pytestmark = pytest.mark.slow


def test_the_smallest_run_reports_both_servers() -> None:
    r = grpc_unary_wait.run(
        streams=8, work_us=50.0, seconds=1.0, every_ms=20.0, loaders=1, open_wait_s=120.0
    )
    assert r["acked"] > 0
    for name in ("aio", "sync", "aio_stream", "loop_lag"):
        q = r[name]
        assert q["n"] > 0
        assert 0 <= q["p50_ms"] <= q["p99_ms"] <= q["max_ms"]
    assert r["aio"]["n"] == r["sync"]["n"] == r["aio_stream"]["n"]
