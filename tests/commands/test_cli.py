"""The ``avest`` command line end to end, in-process through ``avest.commands.cli.main``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from avest.commands.cli import main
from avest.core.rule_factory import make_rule
from avest.core.rules import RecursiveRule, VllmRule
from avest.offline.evaluate import METHODS
from avest.offline.trace import write_trace
from tests.support.traces import replay_core

pytestmark = pytest.mark.slow


@pytest.fixture
def chat_slice(trace_slice, tmp_path):
    path = tmp_path / "chat-slice.npz"
    write_trace(path, trace_slice("chat", 0, 250))
    return path, trace_slice("chat", 0, 250)


def test_evaluate_json_on_a_slice_of_a_shared_trace(chat_slice, capsys):
    path, trace = chat_slice
    assert main(["evaluate", str(path), "--refit-interval", "50", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == str(path)
    assert out["labelled"] == trace.labelled_count()
    assert set(out["methods"]) == set(METHODS)
    assert out["methods"]["lossy-sampled"]["lossless"] is False
    vllm = replay_core(trace, VllmRule(), 50)
    assert out["methods"]["vllm"]["slope"] == vllm.coefficients.slope
    assert out["methods"]["vllm"]["auc"] == pytest.approx(vllm.calibration.summary().auc, abs=1e-12)
    rec = replay_core(trace, RecursiveRule(), 50)
    assert out["methods"]["recursive"]["intercepts"] == list(rec.coefficients.intercepts)
    # The default rule, and the same rule with the calibration layer: same
    # coefficients (the layer never touches the IRLS sums), served predictions scored.
    default = replay_core(trace, make_rule("tracking"), 50)
    assert out["methods"]["tracking"]["slope"] == default.coefficients.slope
    assert out["methods"]["tracking"]["logloss"] == pytest.approx(
        default.calibration.summary().logloss, abs=1e-12
    )
    assert out["methods"]["calibrated"]["intercepts"] == list(default.coefficients.intercepts)
    layered = replay_core(trace, make_rule("tracking"), 50, calibrate=True)
    assert out["methods"]["calibrated"]["ece"] == pytest.approx(
        layered.calibration.summary().ece, abs=1e-12
    )
    for m in out["methods"].values():
        assert len(m["auc_by_position"]) == trace.k
        assert 0.0 < m["ece"] < 1.0
    # The oracle ranks best: it knows the true acceptance probability.
    assert out["methods"]["oracle"]["auc"] > out["methods"]["vllm"]["auc"]


def test_evaluate_from_scores_the_second_half_only(chat_slice, capsys):
    path, trace = chat_slice
    assert main(["evaluate", str(path), "--from", "0.5", "--json", "--method", "vllm"]) == 0
    out = json.loads(capsys.readouterr().out)
    observed, _ = trace.slice_steps(125, None).labels()
    assert out["scored_labelled"] == int(observed.sum()) < out["labelled"]
    assert list(out["methods"]) == ["vllm"]


def test_evaluate_table_and_plots(chat_slice, tmp_path, capsys):
    path, _ = chat_slice
    assert main(["evaluate", str(path), "--plot", str(tmp_path / "plots")]) == 0
    table = capsys.readouterr().out
    for name in METHODS:
        assert name in table
    assert "not lossless" in table
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["chat-slice-positions.png", "chat-slice-reliability.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_evaluate_refuses_a_broken_trace(tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    np.savez(bad, features=np.zeros((2, 3), dtype=np.float32))
    assert main(["evaluate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.npz" in err and "array 'meta'" in err


def test_audit_json_flags_only_the_lossy_rule(capsys):
    assert main(["audit", "--trials", "40000", "--json"]) in (0, 1)
    out = json.loads(capsys.readouterr().out)
    rows = out["results"] if isinstance(out, dict) and "results" in out else out
    biased = {(r["rule"], r["drafter"]) for r in rows if r["verdict"] == "BIASED"}
    assert biased and all(
        rule == "argmax" and drafter == "autoregressive" for rule, drafter in biased
    )
