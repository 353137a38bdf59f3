"""``avest fleet``: in-worker against pooled estimators, on stationary synthetic fleets
with known answers, and the fleet's goodput under a cost profile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from avest.commands.cli import main
from avest.offline.fleet import (
    IN_WORKER,
    POOLED,
    POOLED_CALIBRATED,
    POOLED_COLD,
    Fleet,
    evaluate_fleet,
    worker_steps,
)
from avest.offline.simulate.fleet import simulate_fleet
from avest.offline.simulate.profiles import CostProfile
from avest.offline.trace import write_trace

pytestmark = pytest.mark.slow

# Stationary truth far from the cold start (slope 0.5, intercepts -0.2), so
# learning sooner shows.
TRUTH = {"slope": 1.0, "intercepts": [1.5, 1.0, 0.5, 0.0, -0.5]}
PROPOSAL = CostProfile.from_curves(
    "proposal", [(1, 1.0), (64, 1.0)], [(1, 10.1), (2, 10.2)], draft_per="proposal"
)


@pytest.fixture
def stationary(make_synthetic_trace):
    return make_synthetic_trace(steps=300, requests=16, k=5, seed=7, **TRUTH)


def summaries(report):
    return {n: s.overall.summary() for n, s in report.scores.items()}


def test_worker_steps_split_every_step_by_request_mod_w(stationary) -> None:
    seen = np.zeros(stationary.rows, dtype=int)
    for ws in worker_steps(stationary, 3):
        assert np.all(stationary.request[ws.rows] % 3 == ws.worker)
        assert len(set(stationary.step[ws.rows].tolist())) == 1
        seen[ws.rows] += 1
    assert np.all(seen == 1)


def test_one_worker_pooled_is_the_in_worker_estimator(stationary) -> None:
    # Same rule, one worker, no restarts: pooling changes nothing, to the last bit.
    fleet = Fleet(
        workers=1, restart_every=0, pooled_rule="vllm", calibrate=False, refit_interval=20
    )
    report = evaluate_fleet(stationary, fleet)
    s = summaries(report)
    for name in (POOLED, POOLED_COLD):
        assert s[name] == s[IN_WORKER]
    assert report.worker_steps == stationary.num_steps and report.restarts == 0
    # Restarted every 60 steps: the cold pooled estimator restarts with the worker,
    # the warm one keeps learning and is better calibrated after each restart.
    restarted = evaluate_fleet(
        stationary, Fleet(1, 60, pooled_rule="vllm", calibrate=False, refit_interval=20)
    )
    s = summaries(restarted)
    assert s[POOLED_COLD] == s[IN_WORKER]
    assert restarted.restarts == (stationary.num_steps - 1) // 60
    early = {n: v.early.summary() for n, v in restarted.scores.items()}
    assert early[POOLED].logloss < early[IN_WORKER].logloss - 0.01
    assert early[POOLED].ece < early[IN_WORKER].ece


def test_pooling_beats_each_worker_alone(stationary) -> None:
    # Eight workers, the same rule on both sides: only the pooling differs.
    report = evaluate_fleet(
        stationary, Fleet(8, 0, pooled_rule="vllm", calibrate=False, refit_interval=20)
    )
    s = summaries(report)
    assert s[POOLED].logloss < s[IN_WORKER].logloss - 0.005
    assert s[POOLED].ece < s[IN_WORKER].ece
    assert s[POOLED] == s[POOLED_COLD]  # no restarts: nothing to reset
    # Every estimator scores the same drafts.
    counts = {n: v.overall.count for n, v in report.scores.items()}
    assert len(set(counts.values())) == 1 and counts[POOLED] == stationary.labelled_count()


def test_default_fleet_has_the_calibration_layer_row(stationary) -> None:
    report = evaluate_fleet(stationary.slice_steps(0, 100), Fleet(workers=2))
    assert list(report.scores) == [IN_WORKER, POOLED, POOLED_CALIBRATED, POOLED_COLD]
    out = report.as_json()
    assert out["pooled_rule"] == Fleet().pooled_rule
    assert out["estimators"][POOLED_CALIBRATED]["overall"]["drafts"] > 0


def test_fleet_goodput_speculation_off_by_hand_and_one_worker_pooled(stationary) -> None:
    trace = stationary.slice_steps(0, 50)
    fleet = Fleet(
        workers=1, restart_every=0, pooled_rule="vllm", calibrate=False, refit_interval=20
    )
    g = simulate_fleet(trace, fleet, PROPOSAL, 8, steps=120)
    # Speculation off: 8 tokens per step, no draft, verify(8) = 10.8 ms.
    off = g.results["fixed-0"]
    assert off.tokens.tolist() == [120 * 8]
    assert off.time_ms.tolist() == pytest.approx([120 * 10.8])
    assert g.cycles == pytest.approx(120 * 8 / trace.rows, abs=0.01)
    # One worker with the same rule: in-worker and pooled make the same decisions.
    assert g.results[POOLED].tokens.tolist() == g.results[IN_WORKER].tokens.tolist()
    assert g.results[POOLED].time_ms.tolist() == g.results[IN_WORKER].time_ms.tolist()
    assert g.results["oracle"].throughput >= g.results[g.best_fixed()].throughput


def test_cli_prints_the_fleet_table_and_json(stationary, tmp_path: Path, capsys) -> None:
    path = tmp_path / "s.npz"
    write_trace(path, stationary.slice_steps(0, 120))
    argv = ["fleet", str(path), "--workers", "1,2", "--restart-every", "0,50"]
    assert main([*argv, "--no-goodput"]) == 0
    text = capsys.readouterr().out
    for name in (IN_WORKER, POOLED, POOLED_CALIBRATED, POOLED_COLD):
        assert name in text
    assert (
        main([*argv[:2], "--workers", "2", "--restart-every", "50", "--steps", "60", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)["fleets"][0]
    assert out["workers"] == 2 and out["restart_every"] == 50
    assert out["goodput"]["profile"] == "a100-llama8b-parallel"
    assert "fixed-0" in out["goodput"]["policies"]
    assert main(["fleet", str(path), "--workers", "0"]) == 2
    assert "--workers: must be integers >= 1" in capsys.readouterr().err
