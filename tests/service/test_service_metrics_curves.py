"""The dashboard's curves, scraped from a real service on 127.0.0.1:0: survival
through position i and the reliability bins, against what the gRPC and admin
HTTP APIs say about the same pair and against a plain count over the trace."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from avest.metrics import names as N
from avest_wire.bins import ECE_BINS
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import Live, messages, observe, register
from tests.support.metrics import scrape, select, value


def curve(samples: Any, name: str, pid: str, label: str, n: int) -> list[float]:
    assert len(select(samples, name, pair=pid)) == n, name
    return [value(samples, name, pair=pid, **{label: str(i)}) for i in range(n)]


def test_curves_exist_from_registration_and_are_nan_until_drafts(live: Live) -> None:
    pid = register(live, k=4)
    samples = scrape(live)
    for name in (N.PREDICTED_SURVIVAL, N.OBSERVED_SURVIVAL):
        assert all(math.isnan(v) for v in curve(samples, name, pid, "position", 4)), name
        assert not select(samples, name, pair=pid, position="4")
    assert curve(samples, N.RELIABILITY_DRAFTS, pid, "bin", ECE_BINS) == [0.0] * ECE_BINS
    for name in (N.RELIABILITY_PREDICTED, N.RELIABILITY_OBSERVED):
        assert all(math.isnan(v) for v in curve(samples, name, pid, "bin", ECE_BINS)), name
    assert not select(samples, N.RELIABILITY_DRAFTS, pair=pid, bin=str(ECE_BINS))
    for spec in N.CURVE_METRICS:
        assert spec.kind == "gauge" and spec in N.METRICS


def _fed(live: Live, trace_slice: Any) -> tuple[Any, str]:
    """The sample's first 200 steps observed by a new pair (a refit every 10 steps):
    the trace and the pair's id."""
    trace = trace_slice("sample", 0, 200)
    pid = register(live, k=trace.k, refit_interval=10)
    assert observe(live, messages(trace, pid)) == 200
    return trace, pid


def test_survival_is_the_running_product_of_the_per_position_rates(
    live: Live, trace_slice: Any
) -> None:
    trace, pid = _fed(live, trace_slice)
    pair = live.stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair
    samples = scrape(live)

    by_pos = pair.calibration.by_position
    predicted = curve(samples, N.PREDICTED_SURVIVAL, pid, "position", trace.k)
    observed = curve(samples, N.OBSERVED_SURVIVAL, pid, "position", trace.k)
    for i in range(trace.k):
        assert predicted[i] == pytest.approx(
            math.prod(p.mean_predicted for p in by_pos[: i + 1]), rel=1e-12
        )
        assert observed[i] == pytest.approx(
            math.prod(p.observed for p in by_pos[: i + 1]), rel=1e-12
        )
    # Never rising with the position, and all in [0, 1].
    for seq in (predicted, observed):
        assert all(0.0 <= v <= 1.0 for v in seq), seq
        assert all(a >= b for a, b in zip(seq, seq[1:], strict=False)), seq
    # The observed curve is the fraction of drafts whose positions 0..i were all
    # accepted, counted straight from the trace (the sample verifies every
    # drafted position), which is what vLLM's per-position counters count.
    drafted = trace.num_verified > 0
    for i in range(trace.k):
        exact = (trace.num_accepted[drafted] > i).sum() / drafted.sum()
        assert observed[i] == pytest.approx(exact, rel=1e-9), i
    # 1 + the sum of the curve is the mean acceptance length, incl. the bonus token.
    mean_length = 1 + trace.num_accepted[drafted].mean()
    assert 1 + sum(observed) == pytest.approx(mean_length, rel=1e-9)


def test_reliability_bins_are_the_admin_apis_reliability_diagram(
    live: Live, trace_slice: Any
) -> None:
    trace, pid = _fed(live, trace_slice)
    samples = scrape(live)
    r = live.http.get(f"/v1/pairs/{pid}/reliability")
    assert r.status_code == 200, r.text
    bins = r.json()["bins"]
    assert len(bins) == ECE_BINS

    drafts = curve(samples, N.RELIABILITY_DRAFTS, pid, "bin", ECE_BINS)
    predicted = curve(samples, N.RELIABILITY_PREDICTED, pid, "bin", ECE_BINS)
    observed = curve(samples, N.RELIABILITY_OBSERVED, pid, "bin", ECE_BINS)
    for b, want in enumerate(bins):
        assert drafts[b] == pytest.approx(want["count"], abs=1e-9)
        for got, key in ((predicted[b], "mean_predicted"), (observed[b], "observed")):
            if want[key] is None:
                assert math.isnan(got) and drafts[b] == 0, (b, key)
            else:
                assert got == pytest.approx(want[key], abs=1e-12), (b, key)
        if drafts[b] > 0:  # a bin's mean prediction lies in the bin
            assert want["lower"] <= predicted[b] <= want["upper"], (b, want)
    # Every labelled draft is in exactly one bin; some bins are filled.
    pair = live.stub.GetPair(pb.GetPairRequest(pair_id=pid)).pair
    assert sum(drafts) == pytest.approx(pair.drafts_observed, abs=1e-6)
    assert sum(1 for d in drafts if d > 0) >= 3
    # The drafts-weighted gap between the bins' predicted and observed rates is the ECE.
    filled = [b for b in range(ECE_BINS) if drafts[b] > 0]
    ece = sum(drafts[b] * abs(predicted[b] - observed[b]) for b in filled) / sum(drafts)
    assert ece == pytest.approx(value(samples, N.ECE, pair=pid), abs=1e-9)
    assert np.isfinite(ece)
