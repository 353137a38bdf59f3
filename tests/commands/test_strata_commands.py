"""Strata on the command line: ``avest traces merge``, ``avest evaluate --strata`` and
``avest fleet``'s per-stratum report.

A merged trace is what :func:`avest.offline.strata.merge_traces` makes and reads back
as it was written; ``evaluate --strata`` prints :func:`avest.offline.strata.evaluate_strata`'s
numbers (which are sklearn's measures of the drafts as each method served them), as
strict JSON (an undefined measure ``null``) and as a table whose columns line up
whatever a stratum is called; ``fleet`` with one worker and no restarts replays the
same estimators, so its per-stratum numbers are the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from avest.commands.cli import main
from avest.core.numeric import sigmoid
from avest.offline.evaluate import Steps
from avest.offline.strata import (
    METHODS,
    OVERALL,
    evaluate_strata,
    merge_traces,
    replay_strata,
)
from avest.offline.trace import Trace, read_trace, write_trace
from tests.support.tables import assert_lined_up, tables
from tests.support.traces import make_synthetic_trace

#: The shared greedy trace (T = 0, K = 5) and the code trace (T = 0.7, K = 6).
GREEDY = "greedy-shift-story-chat-rtn4g64-t0-k5.npz"
CODE = "code"


def strict(text: str) -> Any:
    """``json.loads`` refusing the NaN and Infinity Python's own parser lets through."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def sources(trace_slice, tmp_path: Path) -> list[tuple[Path, Trace]]:
    """Slices of the greedy and code traces, written as files (different lengths and K)."""
    out = []
    for name, stop in ((GREEDY, 60), (CODE, 80)):
        trace = trace_slice(name, 0, stop)
        path = write_trace(tmp_path / f"{name.split('-')[0]}.npz", trace)
        out.append((path, trace))
    return out


@pytest.fixture
def merged(sources, tmp_path: Path, capsys) -> Path:
    out = tmp_path / "mixed.npz"
    assert main(["traces", "merge", str(out), *(str(p) for p, _ in sources)]) == 0
    capsys.readouterr()
    return out


def test_merge_writes_what_merge_traces_makes(sources, tmp_path: Path, capsys) -> None:
    out = tmp_path / "mixed.npz"
    assert main(["traces", "merge", str(out), *(str(p) for p, _ in sources)]) == 0
    said = capsys.readouterr().out
    back = read_trace(out)
    want = merge_traces([t for _, t in sources], names=[p.name for p, _ in sources])
    for name, array in want.arrays().items():
        if name != "meta":
            np.testing.assert_array_equal(back.arrays()[name], array, err_msg=name)
    assert back.meta["sources"] == want.meta["sources"]
    assert back.k == min(t.k for _, t in sources)
    assert back.num_steps == min(t.num_steps for _, t in sources)
    counts = {s: int((back.strata() == s).sum()) for s in set(back.strata())}
    assert set(counts) == {"greedy", "t0.5-1"}
    for name, n in counts.items():
        assert f"{name} {n}" in said
    assert str(out) in said and f"{back.num_steps} steps" in said


def test_merge_labels_k_and_longest(sources, tmp_path: Path, capsys) -> None:
    out = tmp_path / "labelled.npz"
    paths = [str(p) for p, _ in sources]
    argv = ["traces", "merge", str(out), *paths, "--label", "lora-a/greedy", "--label", "-"]
    assert main([*argv, "--k", "3", "--longest"]) == 0
    capsys.readouterr()
    back = read_trace(out)
    assert back.k == 3 and back.num_verified.max() <= 3
    assert back.num_steps == max(t.num_steps for _, t in sources)
    # The label replaces the first trace's stratum; '-' keeps the second's own.
    assert set(back.strata()) == {"lora-a/greedy", "t0.5-1"}
    assert int((back.strata() == "lora-a/greedy").sum()) == sources[0][1].rows


@pytest.mark.parametrize(
    ("extra", "problem"),
    [
        (["--label", "a"], "--label: given 1 time(s) for 2 trace(s)"),
        (["--k", "6"], "--k: k must lie in [1, 5]"),
        (["--label", "a\tb", "--label", "c"], "argument --label: must be a stratum name"),
    ],
)
def test_merge_refuses_in_one_line(sources, tmp_path: Path, capsys, extra, problem) -> None:
    out = tmp_path / "refused.npz"
    assert main(["traces", "merge", str(out), *(str(p) for p, _ in sources), *extra]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_evaluate_strata_json_is_evaluate_strata_and_sklearn(merged: Path, capsys) -> None:
    argv = ["evaluate", str(merged), "--strata", "--refit-interval", "20", "--from", "0.25"]
    assert main([*argv, "--json"]) == 0
    got = strict(capsys.readouterr().out)
    trace = read_trace(merged)
    report = evaluate_strata(trace, str(merged), refit_interval=20, from_fraction=0.25)
    assert got == json.loads(json.dumps(report.as_json()))
    assert got["strata"] == ["greedy", "t0.5-1"]
    assert list(got["methods"]) == list(METHODS)
    # Each number is sklearn's measure of the drafts as the method served them.
    steps = Steps.of(trace)
    first = steps.bounds[int(round(0.25 * len(steps.bounds)))][0]
    strata = trace.strata()[first:]
    for method in METHODS:
        eta, _ = replay_strata(steps, trace.strata(), method, 20)
        eta, obs, acc = eta[first:], steps.observed[first:], steps.accepted[first:]
        for name in [*got["strata"], OVERALL]:
            rows = strata == name if name != OVERALL else np.ones(len(strata), bool)
            p, y = sigmoid(eta[rows][obs[rows]]), acc[rows][obs[rows]]
            m = got["methods"][method]["measures"][name]
            assert m["drafts"] == y.size > 0
            assert m["auc"] == pytest.approx(roc_auc_score(y, p), abs=1e-12)
            assert m["logloss"] == pytest.approx(log_loss(y, p, labels=[False, True]), rel=1e-9)
    for method in METHODS:
        by = got["methods"][method]["measures"]
        assert by["greedy"]["drafts"] + by["t0.5-1"]["drafts"] == by[OVERALL]["drafts"]


def test_evaluate_strata_table_prints_the_reports_numbers(merged: Path, capsys) -> None:
    assert main(["evaluate", str(merged), "--strata", "--refit-interval", "20"]) == 0
    out = capsys.readouterr().out
    report = evaluate_strata(read_trace(merged), str(merged), refit_interval=20)
    [(spans, lines)] = tables(out)
    assert_lined_up(spans, lines)
    rows = [line.split() for line in lines[1:]]
    stratum = None
    seen = set()
    for row in rows:
        if row[0] not in METHODS:
            stratum, row = row[0], row[1:]
        method, drafts, auc, logloss, ece = row[:5]
        m = report.measures[method][stratum]
        assert (int(drafts), auc, logloss, ece) == (
            m.drafts,
            f"{m.auc:.4f}",
            f"{m.logloss:.4f}",
            f"{m.ece:.4f}",
        )
        seen.add((stratum, method))
    assert seen == {(s, m) for s in [*report.strata, OVERALL] for m in METHODS}


def test_strict_json_and_aligned_columns_with_an_undefined_measure(tmp_path: Path, capsys) -> None:
    """A stratum whose every draft is accepted has no AUC: ``null`` in the JSON, ``-``
    in the table, whose columns line up around a long stratum name."""
    parts = [
        make_synthetic_trace(steps=30, requests=4, k=3, seed=1),
        make_synthetic_trace(steps=30, requests=4, k=3, seed=2, intercepts=60.0),
    ]
    long_name = "an-adapter-with-a-rather-long-name/t>=1"
    path = write_trace(tmp_path / "m.npz", merge_traces(parts, labels=["greedy", long_name]))
    argv = ["evaluate", str(path), "--strata", "--refit-interval", "5"]
    assert main([*argv, "--json"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text
    got = strict(text)
    for method in METHODS:
        assert got["methods"][method]["measures"][long_name]["auc"] is None
        assert got["methods"][method]["measures"]["greedy"]["auc"] is not None
    assert main(argv) == 0
    out = capsys.readouterr().out
    [(spans, lines)] = tables(out)
    assert_lined_up(spans, lines)
    row = next(line for line in lines if line.startswith(long_name))
    assert row.split()[3] == "-"  # its AUC


def test_evaluate_strata_refuses_what_does_not_apply(merged: Path, capsys, tmp_path) -> None:
    for extra, problem in (
        (["--method", "mle"], "--method mle: not a method of --strata"),
        (["--plot", str(tmp_path / "plots")], "--plot does not apply with --strata"),
    ):
        assert main(["evaluate", str(merged), "--strata", *extra]) == 2
        err = capsys.readouterr().err
        assert problem in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "plots").exists()
    # --method picks among the strata's methods.
    assert main(["evaluate", str(merged), "--strata", "--method", "strata", "--json"]) == 0
    assert list(strict(capsys.readouterr().out)["methods"]) == ["strata"]


def test_fleet_reports_per_stratum_when_the_trace_has_strata(merged: Path, capsys) -> None:
    """One worker, no restarts: in-worker, pooled and pooled+strata are vllm, one-set and
    strata replayed alike, so the per-stratum numbers are evaluate_strata's."""
    argv = ["fleet", str(merged), "--workers", "1", "--restart-every", "0"]
    argv += ["--refit-interval", "20", "--no-goodput"]
    assert main([*argv, "--json"]) == 0
    [fleet] = strict(capsys.readouterr().out)["fleets"]
    report = evaluate_strata(read_trace(merged), str(merged), refit_interval=20)
    assert fleet["strata"]["names"] == report.strata
    assert "pooled+strata" in fleet["estimators"]
    same = {"in-worker": "vllm", "pooled": "one-set", "pooled+strata": "strata"}
    for estimator, method in same.items():
        for name in [*report.strata, OVERALL]:
            got = fleet["strata"]["estimators"][estimator][name]
            want = report.measures[method][name]
            assert got["drafts"] == want.drafts
            for measure in ("auc", "logloss", "ece"):
                assert got[measure] == pytest.approx(getattr(want, measure), abs=1e-12)
    assert main(argv) == 0
    out = capsys.readouterr().out
    found = tables(out)
    assert len(found) == 2  # the headline, then per stratum
    for spans, lines in found:
        assert_lined_up(spans, lines)
    assert "per stratum (greedy, t0.5-1)" in out


def test_fleet_without_strata_reports_as_before(sources, capsys) -> None:
    path = str(sources[1][0])
    argv = ["fleet", path, "--workers", "1,2", "--restart-every", "0", "--no-goodput"]
    assert main([*argv, "--json"]) == 0
    for fleet in strict(capsys.readouterr().out)["fleets"]:
        assert "strata" not in fleet and "pooled+strata" not in fleet["estimators"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(tables(out)) == 1 and "per stratum" not in out
