"""The shim benchmarks time a path that worked, or fail loudly (bench/shim_costs.py).

``bench/bench_summary.py --shim-only`` once printed a figure for summary mode with its
sketch while every round summary was refused on the host (its stand-in left vLLM's
round sums empty, so the sketch's drafts differed from the counts). Here its measuring
functions run on a tiny setting: the summaries must be built, carry a sketch, pass the
host's check and the service's parse; a stand-in that leaves the sums empty (or fills
them wrong) must end the benchmark with SystemExit naming the variant.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from avest_client.vllm import strata as strata_mod
from avest_wire.messages import summary_from_pb, summary_to_pb

BENCH = Path(__file__).resolve().parents[2] / "bench"
#: 0.2 ms after each step (the GIL yielded) lets the sender keep up, as in a worker
TINY = dict(batch=16, k=4, n=240, blocks=2, gap_s=0.0002)


@pytest.fixture
def shim_costs(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/shim_costs.py, imported as the benchmark scripts import it (their folder on
    the path)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("shim_costs")


@pytest.fixture
def received(shim_costs: ModuleType, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every round summary any bench sink receives."""
    got: list[Any] = []
    keep = shim_costs.SummarySink.submit_summary

    def submit_summary(self: Any, summary: Any, stratum: str | None = None) -> None:
        got.append(summary)
        keep(self, summary, stratum)

    monkeypatch.setattr(shim_costs.SummarySink, "submit_summary", submit_summary)
    # the strata variant gives its shim a registry of its own: the process's is restored
    monkeypatch.setattr(strata_mod, "REGISTRY", strata_mod.REGISTRY)
    return got


def test_summaries_with_sketches_are_built_and_accepted(
    shim_costs: ModuleType, received: list[Any]
) -> None:
    res = shim_costs.bench_overhead(**TINY)
    for name in ("summary + sketch (by reference)", "summary + sketch (copies)"):
        r = res[name]
        assert r["summaries"] >= 2, (name, r)
        # a round the sender fell behind on goes without its sketch, and is counted
        assert r["sketches"] > 0, (name, r)
        assert r["sketches"] + r["sketches_skipped"] == r["summaries"], (name, r)
        assert r["drafts"] > 0, (name, r)
    assert res["summary + sketch (by reference)"]["copy_mode"] == 0.0
    assert res["summary + sketch (copies)"]["copy_mode"] == 1.0
    plain = res["summary, no sketch"]
    assert plain["summaries"] >= 2 and plain["sketches"] == 0 and plain["drafts"] > 0
    assert res["raw"]["raw_steps"] > 0
    # four strata: one summary per stratum per round (each with its sketch unless the
    # sender fell behind: the check fails the benchmark on a round sent pooled)
    strata = res["summary + sketch, 4 strata"]
    assert strata["summaries"] >= 8 and strata["sketches"] > 0 and strata["drafts"] > 0

    step = shim_costs.bench_strata_step(TINY["batch"], TINY["k"], n=120, repeats=1)
    assert step["one_set_us"] > 0 and step["strata_us"] > 0

    record = shim_costs.bench_record(TINY["batch"], TINY["k"], blocks=3)
    assert record["summaries"] == record["sketches"] == 6

    assert received
    k = TINY["k"]
    for s in received:
        assert s.drafts > 0 and s.drafts == int(s.counts.sum())
        # what the service does with it: parsed and checked again from the wire
        back = summary_from_pb(summary_to_pb(s), k)
        assert back.drafts == s.drafts
        assert (back.sketch is None) == (s.sketch is None)
        if s.sketch is not None:
            assert (back.sketch.drafts_per_position() == s.counts).all()


def test_a_stand_in_that_leaves_the_sums_empty_fails_the_benchmark(
    shim_costs: ModuleType,
) -> None:
    class EmptySums(shim_costs.NullEstimator):  # type: ignore[name-defined, misc]
        """The stand-in as it was: propose's features, vLLM's sums never filled."""

        def device_work(self, step: Any) -> None:
            self.load_features(step.idx, step.features)

    with pytest.raises(SystemExit) as failed:
        shim_costs.bench_overhead(**TINY, base=EmptySums)
    message = str(failed.value)
    assert message.startswith("bench: 'summary + sketch (by reference)' timed a path that failed")
    # rounds with a sketch are refused; one the sender skipped the sketch of is not, but
    # covers no drafts
    assert "round summaries refused on the host" in message or "cover no drafts" in message


def test_summaries_without_a_sketch_that_cover_no_drafts_fail_the_benchmark(
    shim_costs: ModuleType,
) -> None:
    """Without a sketch nothing on the host compares the sums with the steps: the count
    of drafts each summary covers does."""

    class EmptySums(shim_costs.NullEstimator):  # type: ignore[name-defined, misc]
        def device_work(self, step: Any) -> None:
            self.load_features(step.idx, step.features)

    (no_sketch,) = [v for v in shim_costs.OVERHEAD_VARIANTS if v[0] == "summary, no sketch"]
    with pytest.raises(SystemExit, match=r"'summary, no sketch'.* cover no drafts"):
        shim_costs.bench_overhead(**TINY, base=EmptySums, variants=(no_sketch,))


def test_sums_that_disagree_with_the_sketch_fail_the_benchmark(shim_costs: ModuleType) -> None:
    class Twice(shim_costs.NullEstimator):  # type: ignore[name-defined, misc]
        """Each step's drafts added to the sums twice: the counts differ from the sketch."""

        def device_work(self, step: Any) -> None:
            super().device_work(step)
            self._accumulate(step.idx, step.sampled, step.rejected)

    with pytest.raises(SystemExit, match=r"'summary \+ sketch \(by reference\)'.*refused"):
        shim_costs.bench_overhead(**TINY, base=Twice)


def test_a_sink_that_receives_nothing_fails_the_benchmark(
    shim_costs: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shim_costs.SummarySink, "submit_summary", lambda self, summary: None)
    with pytest.raises(SystemExit, match="the sink received no round summary"):
        shim_costs.bench_overhead(**TINY)


def test_strata_that_never_reach_the_summaries_fail_the_benchmark(
    shim_costs: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admissions that never reach the registry: every row is the pair's pooled
    traffic, and the strata variant would time one coefficient set."""
    monkeypatch.setattr(strata_mod, "REGISTRY", strata_mod.REGISTRY)
    monkeypatch.setattr(strata_mod.StrataRegistry, "record", lambda *a, **kw: None)
    (variant,) = [v for v in shim_costs.OVERHEAD_VARIANTS if v[4]]
    with pytest.raises(SystemExit, match=r"'summary \+ sketch, 4 strata'.* named 0 strata"):
        shim_costs.bench_overhead(**TINY, variants=(variant,))
