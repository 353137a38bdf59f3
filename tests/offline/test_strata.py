"""Strata offline: the trace's ``stratum`` array, mixed traces, and measures per stratum."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from sklearn.metrics import log_loss, roc_auc_score

from avest.core.numeric import sigmoid
from avest.offline.strata import (
    OVERALL,
    cut_to_k,
    evaluate_strata,
    format_strata,
    measures_by_stratum,
    merge_traces,
    reverse_steps,
)
from avest.offline.trace import TraceError, read_trace, write_trace
from avest_wire.strata import stratum_of

#: The shared greedy trace (T = 0, K = 5).
GREEDY = "greedy-shift-story-chat-rtn4g64-t0-k5.npz"


def test_round_trip_with_and_without_stratum(tmp_path, sample_trace) -> None:
    assert sample_trace.stratum is None
    # A trace without the array is one stratum: its temperature's.
    assert set(sample_trace.strata()) == {stratum_of(sample_trace.meta["temperature"])}
    back = read_trace(write_trace(tmp_path / "plain.npz", sample_trace))
    assert back.stratum is None and "stratum" not in back.arrays()
    names = np.where(sample_trace.request % 3 == 0, "greedy", "lora-a/t0.5-1")
    tagged = replace(sample_trace, stratum=names)
    back = read_trace(write_trace(tmp_path / "tagged.npz", tagged))
    np.testing.assert_array_equal(back.stratum, names)
    np.testing.assert_array_equal(back.strata(), names)
    # Slices carry it along.
    head = back.slice_steps(0, 10)
    np.testing.assert_array_equal(head.stratum, names[: head.rows])


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (lambda n: np.arange(n), "string"),
        (lambda n: np.full(n + 1, "greedy"), "shape"),
        (lambda n: np.full((n, 1), "greedy"), "shape"),
        (lambda n: np.where(np.arange(n) == 3, "", "greedy"), "non-empty"),
        (lambda n: np.full(n, "x" * 65), "bytes"),
        (lambda n: np.full(n, "a\nb"), "control"),
        (lambda n: np.full(n, b"greedy"), "string"),
    ],
)
def test_a_bad_stratum_is_refused_naming_the_array(tmp_path, sample_trace, bad, problem) -> None:
    trace = replace(sample_trace, stratum=bad(sample_trace.rows))
    with pytest.raises(TraceError) as info:
        write_trace(tmp_path / "bad.npz", trace)
    assert info.value.array == "stratum" and problem in info.value.problem
    # The same array in a file is refused on read, with the path.
    arrays = {**sample_trace.arrays(), "stratum": bad(sample_trace.rows)}
    np.savez(tmp_path / "bad-file.npz", **arrays)
    with pytest.raises(TraceError) as info:
        read_trace(tmp_path / "bad-file.npz")
    assert info.value.array == "stratum" and "bad-file.npz" in str(info.value)


def test_an_object_stratum_array_is_refused_as_pickled(tmp_path, sample_trace) -> None:
    arrays = {**sample_trace.arrays(), "stratum": np.full(sample_trace.rows, "g", dtype=object)}
    np.savez(tmp_path / "pickled.npz", **arrays)
    with pytest.raises(TraceError) as info:
        read_trace(tmp_path / "pickled.npz")
    assert info.value.array == "stratum" and "pickled" in info.value.problem


def test_merge_mixes_every_step_cut_to_the_smallest_k(trace_slice) -> None:
    greedy = trace_slice(GREEDY, 0, 40)
    code = trace_slice("code", 0, 60)  # K = 6, T = 0.7
    merged = merge_traces([greedy, code], names=["greedy.npz", "code.npz"])
    assert merged.k == 5 == merged.meta["num_speculative_tokens"]
    assert merged.num_steps == 40  # until the shortest ends
    sources = merged.meta["sources"]
    assert [s["strata"] for s in sources] == [["greedy"], ["t0.5-1"]]
    assert [s["steps"] for s in sources] == [40, 40]
    for i, step in enumerate(merged.steps()):
        want = greedy.slice_steps(i, i + 1).rows, code.slice_steps(i, i + 1).rows
        got = (step.strata() == "greedy").sum(), (step.strata() == "t0.5-1").sum()
        assert got == want
    # Requests stay apart; the counts are what a 5-token drafter earned.
    assert len(np.unique(merged.request)) == len(np.unique(greedy.request)) + len(
        np.unique(code.slice_steps(0, 40).request)
    )
    assert merged.num_verified.max() <= 5
    cut = cut_to_k(code.slice_steps(0, 40), 5)
    rows = merged.strata() == "t0.5-1"
    np.testing.assert_array_equal(merged.num_accepted[rows], cut.num_accepted)
    np.testing.assert_array_equal(merged.features[rows], cut.features)
    obs, acc = merged.labels()
    cobs, cacc = code.slice_steps(0, 40).labels()
    np.testing.assert_array_equal(obs[rows], cobs[:, :5])
    np.testing.assert_array_equal(acc[rows], cacc[:, :5])
    # The longest variant, labels, and the steps reversed.
    longest = merge_traces([greedy, code], labels=["a", None], longest=True)
    assert longest.num_steps == 60 and set(longest.strata()) == {"a", "t0.5-1"}
    back = reverse_steps(greedy)
    np.testing.assert_array_equal(
        back.slice_steps(0, 1).features, greedy.slice_steps(39, 40).features
    )
    with pytest.raises(ValueError, match="smallest K"):
        merge_traces([greedy, code], k=6)


def test_measures_per_stratum_are_sklearns(trace_slice) -> None:
    merged = merge_traces([trace_slice(GREEDY, 0, 60), trace_slice("code", 0, 60)])
    rng = np.random.default_rng(0)
    eta = rng.normal(1.0, 1.5, size=merged.features.shape)
    obs, acc = merged.labels()
    strata = merged.strata()
    got = measures_by_stratum(eta, obs, acc, strata, ["greedy", "t0.5-1"])
    for name, rows in (
        ("greedy", strata == "greedy"),
        ("t0.5-1", strata == "t0.5-1"),
        (OVERALL, slice(None)),
    ):
        e, y = eta[rows][obs[rows]], acc[rows][obs[rows]]
        p = sigmoid(e)
        m = got[name]
        assert m.drafts == y.size
        assert m.auc == pytest.approx(roc_auc_score(y, p), abs=1e-12)
        assert m.logloss == pytest.approx(log_loss(y, p, labels=[False, True]), rel=1e-9)
        # ECE by hand: 15 equal-width bins, |mean predicted - observed| weighted by count.
        bins = np.minimum((p * 15).astype(int), 14)
        ece = (
            sum(
                abs(p[bins == b].mean() - y[bins == b].mean()) * (bins == b).sum()
                for b in range(15)
                if (bins == b).any()
            )
            / p.size
        )
        assert m.ece == pytest.approx(ece, abs=1e-12)


def test_one_stratum_scores_as_today_and_a_mix_is_scored_per_stratum(trace_slice) -> None:
    single = trace_slice("code", 0, 120)
    report = evaluate_strata(single, "code", refit_interval=20)
    one, strata = report.measures["one-set"], report.measures["strata"]
    assert report.strata == ["t0.5-1"]
    assert one == strata  # bit for bit: the lone stratum is the pair
    mixed = merge_traces([trace_slice(GREEDY, 0, 120), single])
    report = evaluate_strata(mixed, "mixed", refit_interval=20, from_fraction=0.5)
    assert report.strata == ["greedy", "t0.5-1"]
    for method in ("vllm", "one-set", "strata"):
        by = report.measures[method]
        assert by["greedy"].drafts + by["t0.5-1"].drafts == by[OVERALL].drafts > 0
    slopes = report.coefficients["strata"]
    assert slopes["greedy"] != slopes["t0.5-1"]
    assert report.coefficients["one-set"]["greedy"] == report.coefficients["one-set"]["t0.5-1"]
    table = format_strata(report)
    assert "greedy" in table and "t0.5-1" in table and OVERALL in table


def test_a_merged_trace_round_trips_and_evaluates_as_in_memory(trace_slice, tmp_path) -> None:
    merged = merge_traces(
        [trace_slice(GREEDY, 0, 50), trace_slice("code", 0, 50)], labels=[None, "code/t0.5-1"]
    )
    back = read_trace(write_trace(tmp_path / "mixed.npz", merged))
    np.testing.assert_array_equal(back.stratum, merged.stratum)
    assert back.meta["sources"] == merged.meta["sources"]
    want = evaluate_strata(merged, "m", refit_interval=10)
    got = evaluate_strata(back, "m", refit_interval=10)
    assert got.measures == want.measures and got.coefficients == want.coefficients
    assert got.strata == ["code/t0.5-1", "greedy"]
    # The progress callback counts every step of every method.
    ticks: list[int] = []
    evaluate_strata(back, refit_interval=10, methods=["one-set", "strata"], progress=ticks.append)
    assert sum(ticks) == 2 * back.num_steps


def test_the_strata_table_lines_up_whatever_a_stratum_is_called(trace_slice) -> None:
    long_name = "a-lora-adapter-with-a-long-name/t0.5-1"
    merged = merge_traces(
        [trace_slice(GREEDY, 0, 40), trace_slice("code", 0, 40)], [None, long_name]
    )
    lines = format_strata(evaluate_strata(merged, "m", refit_interval=10)).splitlines()
    rule = lines[2]
    assert set(rule) == {"-", " "}
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    for line in lines[3:]:
        # Every cell starts or ends inside its column: no gap of the rule holds text.
        for i, c in enumerate(rule):
            if c == " ":
                assert line[i : i + 1] in ("", " "), (line, i)
    assert len(starts) == 10 and lines[3].startswith(f"{long_name} vllm")


def test_fleet_with_strata_leaves_the_other_estimators_as_they_were(trace_slice) -> None:
    from avest.offline.fleet import POOLED_STRATA, Fleet, evaluate_fleet

    merged = merge_traces([trace_slice(GREEDY, 0, 60), trace_slice("code", 0, 60)])
    fleet = Fleet(workers=3, restart_every=15, refit_interval=10, early=5)
    plain = evaluate_fleet(merged, fleet, strata=False)
    with_strata = evaluate_fleet(merged, fleet)  # the trace has a stratum array
    assert not plain.by_stratum and POOLED_STRATA not in plain.scores
    assert list(with_strata.scores) == [*plain.scores, POOLED_STRATA]
    # The wrapper feeds the pooled estimator exactly as before: nothing else moves.
    assert {n: with_strata.summaries()[n] for n in plain.scores} == plain.summaries()
    assert with_strata.strata == ["greedy", "t0.5-1"]
    for name, by in with_strata.by_stratum.items():
        assert by["greedy"].drafts + by["t0.5-1"].drafts == by[OVERALL].drafts
        # Overall, the exact measures agree with the running ones up to their binning.
        assert by[OVERALL].drafts == with_strata.scores[name].overall.count
        assert by[OVERALL].logloss == pytest.approx(
            with_strata.scores[name].overall.summary().logloss, rel=1e-6
        )
