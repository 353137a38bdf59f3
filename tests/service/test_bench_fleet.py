"""``bench/bench_fleet.py``'s ``cpu`` section at its smallest against a real ``avest serve``:
its report's counts add up, and a server that refuses every summary fails the run
(SystemExit with a message) instead of reporting figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import bench_fleet  # noqa: E402

pytestmark = pytest.mark.slow

#: Four workers, one client process; 100 summaries each, so that the bare server's CPU
#: (about 0.1 ms a message) spans several of /proc's 10 ms clock ticks.
SMALL = ["--cpu", "--workers", "4", "--summaries", "100", "--client-procs", "1"]


def test_cpu_section_counts_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_fleet.main([*SMALL, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["servers"]) == ["current"]
    cpu = result["servers"]["current"]["cpu"]
    assert cpu["streams"] == 4
    assert cpu["sent"] == cpu["acked"] == 400
    assert cpu["floor_messages"] == 400
    assert cpu["server_cpu_us"] > 0 and cpu["floor_server_cpu_us"] > 0
    assert cpu["acked_per_s"] > 0 and cpu["floor_per_s"] > 0
    assert cpu["cpu_ratio_to_floor"] == pytest.approx(
        cpu["server_cpu_us"] / cpu["floor_server_cpu_us"], rel=0.02
    )
    assert cpu["refit_interval"] > 0  # the server's default, not one the benchmark chose
    assert cpu["version_after"] >= cpu["version_before"]
    assert cpu["round_after"] - cpu["round_before"] == cpu["refits"] >= 0
    # every push a stream got was counted on one of the four streams
    assert 0 <= cpu["pushes_per_stream_min"] <= cpu["pushes_per_stream_max"]
    assert "capacity: acked summaries/s" in bench_fleet.report(result)


def test_a_server_refusing_every_summary_fails_the_run() -> None:
    # A real server whose message cap is below one summary (about 6.9 kB) refuses
    # each with RESOURCE_EXHAUSTED; the opening of a worker still fits.
    with pytest.raises(SystemExit) as failed:
        bench_fleet.main([*SMALL, "--server-arg=--max-message-bytes=1024"])
    message = str(failed.value.code)
    assert message.startswith("bench_fleet: FAILED")
    assert "RESOURCE_EXHAUSTED" in message


def test_the_loop_lag_quantiles_are_those_of_the_window() -> None:
    inf = float("inf")
    before = {0.1: 10.0, 1.0: 10.0, inf: 10.0}  # ten beats before the window, all prompt
    after = {0.1: 60.0, 1.0: 109.0, inf: 110.0}  # fifty prompt, 49 under 1 s, one later
    assert bench_fleet._window_quantiles(before, after, (0.5, 0.99, 1.0)) == [0.1, 1.0, inf]
    assert bench_fleet._window_quantiles(None, after, (0.5,)) == [None]  # an older tree
    assert bench_fleet._window_quantiles(after, after, (0.5,)) == [None]  # nothing observed
