"""Mergeable calibration measures against sklearn and direct computations."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from sklearn.metrics import log_loss, roc_auc_score

from avest.core import exact
from avest.core.exact import exact_auc, exact_ece, exact_log_loss
from avest.core.labels import labels
from avest.core.metrics import CalibrationState, auc_from_histograms
from avest.core.numeric import sigmoid
from avest_wire.bins import AUC_SLOTS, ECE_BINS, probability_bin
from avest_wire.bins import eta_slot as eta_bin
from avest_wire.errors import InvalidInput


def direct_ece(p: np.ndarray, y: np.ndarray) -> float:
    """ECE as defined (bin weight times |mean p - observed|), 15 bins, last one closed."""
    b = np.minimum(np.floor(p * 15), 14)
    return float(sum((b == j).mean() * abs(p[b == j].mean() - y[b == j].mean()) for j in set(b)))


def tie_bound(state: CalibrationState, position: int | None) -> float:
    """Largest possible gap between the binned and the exact AUC: half the
    fraction of (accepted, rejected) pairs that share a bin."""
    a = state.to_arrays()
    rej, acc = a["auc_rejected"], a["auc_accepted"]
    at = slice(None) if position is None else [position]
    rej, acc = rej[at].sum(axis=0), acc[at].sum(axis=0)
    return float(0.5 * np.dot(rej, acc) / (rej.sum() * acc.sum()))


def random_batch(rng: np.random.Generator, r: int, k: int, mu: float = 1.0, sd: float = 2.0):
    d = rng.integers(0, k + 1, r)
    a = np.minimum(rng.integers(0, k + 1, r), d)
    return rng.normal(mu, sd, (r, k)), *labels(d, a, k)


def assert_states_equal(merged: CalibrationState, whole: CalibrationState) -> None:
    """Counts exactly equal, float sums to 1e-12."""
    m, w = merged.to_arrays(), whole.to_arrays()
    for key in ("auc_rejected", "auc_accepted", "ece_rejected", "ece_accepted"):
        np.testing.assert_array_equal(m[key], w[key], err_msg=key)
    for key in ("ece_sum_predicted", "logloss_sum"):
        np.testing.assert_allclose(m[key], w[key], rtol=1e-12, atol=1e-12, err_msg=key)


# Cold start, a code fit, and a steep fit with ~20 % of predictions above 0.99.
TRACE_CASES = [("chat", 0.5, -0.2), ("code", 0.55, 0.4), ("chat", 1.2, 3.0), ("sample", 0.5, -0.2)]


@pytest.mark.parametrize(("name", "slope", "intercept"), TRACE_CASES)
def test_measures_match_sklearn_on_traces(trace_slice, name, slope, intercept):
    trace = trace_slice(name)
    eta = slope * trace.features.astype(np.float64) + intercept
    obs, acc = trace.labels()
    state = CalibrationState.of(eta, obs, acc)
    s = state.summary()
    assert len(s.by_position) == eta.shape[1]
    # Per position (a few thousand drafts; hundreds in the sample) the tie
    # error reaches ~1.5e-4 (4e-4 in the sample): it shrinks like 1/n and is
    # far below the AUC's sampling error (~1e-2) at these sizes.
    pooled_tol, per_tol = (1e-4, 3e-4) if name != "sample" else (3e-4, 1e-3)
    for i, summ in [(None, s), *enumerate(s.by_position)]:
        m = obs if i is None else obs & (np.arange(eta.shape[1]) == i)
        e, y = eta[m], acc[m]
        p = sigmoid(e)
        assert summ.count == m.sum()
        err = abs(summ.auc - roc_auc_score(y, e))
        assert err <= tie_bound(state, i) + 1e-12
        assert err < (pooled_tol if i is None else per_tol)
        assert summ.logloss == pytest.approx(log_loss(y, p, labels=[0, 1]), abs=1e-9)
        assert summ.ece == pytest.approx(direct_ece(p, y), abs=1e-12)
        assert summ.mean_predicted == pytest.approx(p.mean(), abs=1e-12)
        assert summ.observed == pytest.approx(y.mean(), abs=1e-15)


# (6, 3) and (4, 1): most predictions above 0.99. (0, 0.3): eta spans a few
# bins, within-bin ties are ~2 % of pairs and the AUC is biased by ~1e-4 even
# at 50k drafts a position, still within the tie bound.
@pytest.mark.parametrize(
    ("mu", "sd", "tol"), [(6, 3, 1e-4), (4, 1, 1e-4), (0, 1, 1e-4), (-1, 4, 1e-4), (0, 0.3, 5e-4)]
)
def test_auc_within_1e4_of_sklearn_on_synthetic_spreads(mu, sd, tol):
    rng = np.random.default_rng(7)
    eta = rng.normal(mu, sd, (50_000, 4)) + np.linspace(0.5, -0.5, 4)
    acc = rng.random(eta.shape) < sigmoid(0.8 * eta + 0.3)
    state = CalibrationState.of(eta, np.ones(eta.shape, bool), acc)
    s = state.summary()
    assert abs(s.auc - roc_auc_score(acc.ravel(), eta.ravel())) < tol
    for i, ps in enumerate(s.by_position):
        err = abs(ps.auc - roc_auc_score(acc[:, i], eta[:, i]))
        assert err < tol and err <= tie_bound(state, i)


def test_eta_binning_beats_probability_binning_near_one():
    """The reason for binning eta: with most predictions near 1, a 200-bin
    probability histogram loses the ranking, the eta histogram keeps it."""
    rng = np.random.default_rng(3)
    eta = rng.normal(7.0, 2.0, 100_000)
    y = rng.random(eta.size) < sigmoid(eta - 4.0)
    exact = roc_auc_score(y, eta)
    ours = CalibrationState.of(eta[:, None], np.ones((eta.size, 1), bool), y[:, None]).summary().auc
    coarse = roc_auc_score(y, np.minimum((sigmoid(eta) * 200).astype(int), 199))
    assert abs(ours - exact) < 1e-4
    assert abs(coarse - exact) > 10 * abs(ours - exact)


def test_binned_auc_is_exact_auc_of_bin_indices():
    rng = np.random.default_rng(1)
    eta, obs, acc = random_batch(rng, 3000, 6, mu=0.0, sd=8.0)  # overflow bins in use
    s = CalibrationState.of(eta, obs, acc).summary()
    assert s.auc == pytest.approx(exact_auc(eta_bin(eta[obs]), acc[obs]), abs=1e-12)
    for i, ps in enumerate(s.by_position):
        m = obs[:, i]
        assert ps.auc == pytest.approx(exact_auc(eta_bin(eta[m, i]), acc[m, i]), abs=1e-12)


def test_bin_edges_and_histogram_ties():
    b = eta_bin([-1e9, -12.0001, -12.0, -11.99, 0.0, 11.99, 12.0, 1e9])
    assert b.tolist() == [0, 0, 1, 1, 513, 1024, 1025, 1025]
    p_edges = [0.0, 1 / 15 - 1e-12, 1 / 15 + 1e-12, 0.999, 1.0]
    assert probability_bin(p_edges).tolist() == [0, 0, 1, 14, 14]
    # one accepted and one rejected draft in the same bin: AUC one half
    assert auc_from_histograms(np.array([0.0, 1.0]), np.array([0.0, 1.0])) == 0.5
    assert auc_from_histograms(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == 1.0
    assert auc_from_histograms(np.array([0.0, 1.0]), np.array([1.0, 0.0])) == 0.0
    assert math.isnan(auc_from_histograms(np.zeros(2), np.array([1.0, 0.0])))


def test_exact_functions_match_sklearn_with_ties():
    rng = np.random.default_rng(2)
    s = np.round(rng.normal(size=500), 1)  # many ties
    y = rng.random(500) < sigmoid(s)
    assert exact_auc(s, y) == pytest.approx(roc_auc_score(y, s), abs=1e-14)
    assert exact_log_loss(s, y) == pytest.approx(log_loss(y, sigmoid(s)), abs=1e-12)
    assert exact_ece(sigmoid(s), y) == pytest.approx(direct_ece(sigmoid(s), y), abs=1e-14)
    assert math.isnan(exact_auc(s, np.ones(500, bool)))
    assert math.isnan(exact_log_loss([], []))


def test_log_loss_stable_for_extreme_eta():  # |eta| = 800: exp(800) would overflow
    eta = np.array([[800.0, -800.0, 800.0, -800.0, 0.0]])
    acc = np.array([[True, False, False, True, True]])
    s = CalibrationState.of(eta, np.ones_like(acc), acc).summary()
    assert s.logloss == pytest.approx((800.0 + 800.0 + math.log(2.0)) / 5, rel=1e-15)
    assert s.mean_predicted == pytest.approx((1 + 0 + 1 + 0 + 0.5) / 5)


def test_merged_state_equals_state_of_concatenated_data():
    rng = np.random.default_rng(4)
    batches = [random_batch(rng, int(rng.integers(0, 300)), 8) for _ in range(12)]
    whole = CalibrationState.of(*(np.concatenate([b[i] for b in batches]) for i in range(3)))
    parts = [CalibrationState.of(*b) for b in batches]
    merged, folded = CalibrationState.empty(8), CalibrationState.empty(8)
    for part, batch in zip(parts, batches, strict=True):
        merged.merge(part)
        folded.update(*batch)
    assert_states_equal(merged, whole)
    assert_states_equal(folded, whole)
    assert_states_equal(sum(parts[1:], parts[0]), whole)
    ms, ws = merged.summary(), whole.summary()
    assert ms.auc == ws.auc and ms.count == ws.count
    assert ms.logloss == pytest.approx(ws.logloss, rel=1e-12)


def test_add_leaves_operands_alone_and_iadd_merges():
    rng = np.random.default_rng(5)
    a, b = (CalibrationState.of(*random_batch(rng, 50, 3)) for _ in range(2))
    a0, b0 = a.copy(), b.copy()
    c = a + b
    assert c.count == a.count + b.count
    assert_states_equal(a, a0)
    assert_states_equal(b, b0)
    a += b
    assert_states_equal(a, c)
    with pytest.raises(InvalidInput) as info:
        CalibrationState.empty(3).merge(CalibrationState.empty(4))
    assert info.value.field == "other"


def test_scale_forgets_and_keeps_ratios():
    rng = np.random.default_rng(6)
    old = CalibrationState.of(*random_batch(rng, 400, 4, mu=2.0))
    new = CalibrationState.of(*random_batch(rng, 400, 4, mu=-1.0))
    before, scaled = old.summary(), old.copy()
    scaled.scale(0.25)
    after = scaled.summary()
    assert after.count == pytest.approx(0.25 * before.count)
    for f in ("auc", "logloss", "ece", "mean_predicted", "observed"):
        assert getattr(after, f) == pytest.approx(getattr(before, f), rel=1e-12)
    mixed = (scaled + new).summary()
    expect = (
        0.25 * before.count * before.mean_predicted + new.count * new.summary().mean_predicted
    ) / (0.25 * before.count + new.count)
    assert mixed.mean_predicted == pytest.approx(expect, rel=1e-12)
    scaled.scale(0.0)
    assert scaled.count == 0.0 and math.isnan(scaled.summary().auc)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(InvalidInput):
            old.scale(bad)


def test_arrays_round_trip_exactly(tmp_path):
    rng = np.random.default_rng(8)
    state = CalibrationState.of(*random_batch(rng, 500, 5))
    state.scale(0.9)
    arrays = state.to_arrays()
    back = CalibrationState.from_arrays(arrays)
    for key, value in back.to_arrays().items():
        np.testing.assert_array_equal(value, arrays[key], err_msg=key)
        # the AUC histograms are a float32 window of the slots; the rest float64
        assert value.dtype == (
            np.float32 if key.startswith("auc_") and key != "auc_first_slot" else np.float64
        )
    assert arrays["auc_rejected"].shape[1] < AUC_SLOTS  # a window, not every slot
    assert back.summary() == state.summary()
    arrays["logloss_sum"][0] += 1.0  # to_arrays hands out copies
    assert CalibrationState.from_arrays(state.to_arrays()).summary() == state.summary()
    np.savez(tmp_path / "s.npz", **state.to_arrays())
    with np.load(tmp_path / "s.npz", allow_pickle=False) as z:
        assert CalibrationState.from_arrays(dict(z)).summary() == state.summary()


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [
        ("layout", None, "layout"),
        ("layout", np.array([200.0, 0.0, 1.0, 15.0]), "layout"),
        ("auc_accepted", None, "auc_accepted"),
        ("auc_accepted", np.zeros((3, AUC_SLOTS - 2)), "auc_accepted"),
        ("ece_rejected", -np.ones((3, ECE_BINS)), "ece_rejected"),
        ("ece_sum_predicted", np.full((3, ECE_BINS), np.nan), "ece_sum_predicted"),
        ("logloss_sum", np.zeros((3, 1)), "logloss_sum"),
        ("ece_accepted", np.full((3, ECE_BINS), 5.0), "auc_accepted"),  # counts disagree
    ],
)
def test_from_arrays_refuses_corrupt_state(key, value, field):
    rng = np.random.default_rng(10)
    arrays = CalibrationState.of(*random_batch(rng, 100, 3)).to_arrays()
    arrays.pop(key) if value is None else arrays.__setitem__(key, value)
    with pytest.raises(InvalidInput) as info:
        CalibrationState.from_arrays(arrays)
    assert info.value.field == field


def test_empty_state_is_all_nan():
    state = CalibrationState.empty(3)
    state.update(np.zeros((0, 3)), np.zeros((0, 3), bool), np.zeros((0, 3), bool))
    s = state.summary()
    assert s.count == 0.0
    for f in ("auc", "logloss", "ece", "mean_predicted", "observed"):
        assert math.isnan(getattr(s, f))
    assert len(s.by_position) == 3 and all(ps.count == 0.0 for ps in s.by_position)
    rel = state.reliability()
    assert rel.count.sum() == 0 and np.isnan(rel.mean_predicted).all()


def test_one_class_and_empty_positions():
    eta = np.array([[1.0, 2.0], [0.5, -1.0]])
    obs = np.ones((2, 2), bool)
    s = CalibrationState.of(eta, obs, obs).summary()
    assert math.isnan(s.auc)
    assert s.observed == 1.0
    assert s.logloss == pytest.approx(log_loss([1, 1, 1, 1], sigmoid(eta.ravel()), labels=[0, 1]))
    assert s.ece == pytest.approx(1.0 - sigmoid(eta).mean())
    # A position without data is NaN while the others are defined.
    eta, obs, acc = np.zeros((4, 3)), np.zeros((4, 3), bool), np.zeros((4, 3), bool)
    obs[:, 0], acc[:2, 0] = True, True
    s = CalibrationState.of(eta, obs, acc).summary()
    assert s.by_position[0].auc == 0.5 and s.by_position[0].count == 4
    assert math.isnan(s.by_position[1].logloss) and s.by_position[2].count == 0
    # Unobserved drafts are ignored, even non-finite ones.
    eta, obs = np.array([[0.3, np.nan, np.inf]]), np.array([[True, False, False]])
    s = CalibrationState.of(eta, obs, np.array([[True, True, False]])).summary()
    assert s.count == 1 and s.observed == 1.0


Z, T = np.zeros((2, 3)), np.ones((2, 3), bool)


@pytest.mark.parametrize(
    ("eta", "obs", "acc", "field"),
    [
        (np.zeros((2, 4)), T, T, "eta"),
        (np.zeros(3), T[0], T[0], "eta"),
        (Z, np.ones((2, 3)), T, "observed"),
        (Z, T, np.ones((3, 3), bool), "accepted"),
        (Z + np.nan, T, T, "eta"),
    ],
)
def test_update_refuses_bad_input_and_changes_nothing(eta, obs, acc, field):
    state = CalibrationState.empty(3)
    state.update(np.ones((1, 3)), np.ones((1, 3), bool), np.zeros((1, 3), bool))
    before = state.to_arrays()
    with pytest.raises(InvalidInput) as info:
        state.update(eta, obs, acc)
    assert info.value.field == field
    for key, value in state.to_arrays().items():
        np.testing.assert_array_equal(value, before[key])


def test_update_counts_matches_update_with_labels():
    rng = np.random.default_rng(11)
    eta, d = rng.normal(size=(300, 5)), rng.integers(0, 6, 300)
    a = np.minimum(rng.integers(0, 6, 300), d)
    via_counts = CalibrationState.empty(5)
    via_counts.update_counts(eta, d, a)
    assert_states_equal(via_counts, CalibrationState.of(eta, *labels(d, a, 5)))
    with pytest.raises(InvalidInput) as info:
        via_counts.update_counts(eta, d, d + 1)
    assert info.value.field == "num_accepted"


def test_reliability_bins():
    rng = np.random.default_rng(12)
    eta, obs, acc = random_batch(rng, 2000, 3)
    eta[np.abs(eta) < 0.41] = 3.0  # empties the bins of p in [0.4, 0.6)
    state = CalibrationState.of(eta, obs, acc)
    rel = state.reliability()
    p, y = sigmoid(eta[obs]), acc[obs]
    assert rel.edges.tolist() == pytest.approx(np.linspace(0, 1, 16).tolist())
    assert rel.count.sum() == obs.sum()
    b = probability_bin(p)
    n = np.bincount(b, minlength=ECE_BINS)
    np.testing.assert_array_equal(rel.count, n)
    assert (n == 0).any() and (n > 0).sum() > 5  # both kinds of bins are exercised
    with np.errstate(invalid="ignore"):
        np.testing.assert_allclose(rel.mean_predicted, np.bincount(b, p, ECE_BINS) / n, rtol=1e-12)
        np.testing.assert_allclose(rel.observed, np.bincount(b, y, ECE_BINS) / n, rtol=1e-12)
    full = n > 0
    assert (rel.edges[:-1][full] <= rel.mean_predicted[full]).all()
    assert (rel.mean_predicted[full] <= rel.edges[1:][full]).all()
    assert state.reliability(2).count.sum() == obs[:, 2].sum()
    with pytest.raises(InvalidInput):
        state.reliability(3)


finite_eta = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw, k: int | None = None):
    shape = (draw(st.integers(0, 40)), draw(st.integers(1, 6)) if k is None else k)
    eta = draw(hnp.arrays(np.float64, shape, elements=finite_eta))
    return eta, draw(hnp.arrays(np.bool_, shape)), draw(hnp.arrays(np.bool_, shape))


@settings(max_examples=150, deadline=None)
@given(batches())
def test_property_measures_match_direct_computation(batch):
    eta, obs, acc = batch
    s = CalibrationState.of(eta, obs, acc).summary()
    e, y = eta[obs], acc[obs]
    assert s.count == e.size
    if e.size == 0:
        assert math.isnan(s.logloss) and math.isnan(s.auc)
        return
    p = sigmoid(e)
    assert s.logloss == pytest.approx(exact_log_loss(e, y), rel=1e-9, abs=1e-12)
    assert s.ece == pytest.approx(exact_ece(p, y), abs=1e-9)
    assert 0.0 <= s.ece <= 1.0
    assert s.observed == pytest.approx(y.mean())
    assert s.auc == pytest.approx(exact_auc(eta_bin(e), y), abs=1e-12, nan_ok=True)
    assert sum(ps.count for ps in s.by_position) == s.count


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 5).flatmap(lambda k: st.lists(batches(k), min_size=1, max_size=5)))
def test_property_merge_equals_concatenation(parts):
    k = parts[0][0].shape[1]
    whole = CalibrationState.of(*(np.concatenate([p[i] for p in parts]) for i in range(3)))
    merged = CalibrationState.empty(k)
    for p in parts:
        merged += CalibrationState.of(*p)
    assert_states_equal(merged, whole)


def _lines_run_in_avest(fn, *args) -> int:
    """Python lines executed inside avest's own modules while ``fn(*args)`` runs."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if "avest" not in frame.f_code.co_filename:
            return None
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def test_update_is_vectorised():
    """The work in Python does not grow with the batch: no per-row or per-draft loop.

    Counted in executed lines, not seconds, so load cannot make it flaky; the
    throughput itself is a benchmark (bench/bench_core.py).
    """
    rng = np.random.default_rng(13)
    lines = []
    for rows in (4, 4096):
        eta, obs, acc = random_batch(rng, rows, 8)
        state = CalibrationState.empty(8)
        state.update(eta, obs, acc)  # the AUC window is allocated on the first batch
        eta, obs, acc = random_batch(rng, rows, 8)
        lines.append(_lines_run_in_avest(state.update, eta, obs, acc))
    assert lines[0] > 0
    assert lines[1] <= lines[0] + 20, lines


def test_the_exact_references_use_the_services_ece_bins():
    assert exact.ECE_BINS == ECE_BINS


def test_the_auc_window_grows_lazily_and_matches_dense_counts():
    """Nothing allocated until drafts arrive; the window covers where they landed,
    grows when later drafts land outside it, and counts what dense histograms count."""
    rng = np.random.default_rng(21)
    state = CalibrationState.empty(4)
    assert state.to_arrays()["auc_rejected"].shape == (4, 0)
    dense = np.zeros((4, 2, AUC_SLOTS))
    for centre in (0.0, 0.5, 6.0, -9.0, 30.0):  # the last lands in the overflow slot
        eta = rng.normal(centre, 0.3, size=(64, 4))
        obs, acc = rng.random((64, 4)) < 0.8, rng.random((64, 4)) < 0.5
        state.update(eta, obs, acc)
        pos = np.broadcast_to(np.arange(4), eta.shape)
        np.add.at(dense, (pos[obs], acc[obs].astype(int), eta_bin(eta[obs])), 1.0)
        a = state.to_arrays()
        first, width = int(a["auc_first_slot"][0]), a["auc_rejected"].shape[1]
        used = np.flatnonzero(dense.any(axis=(0, 1)))
        assert first <= used.min() and used.max() < first + width
        np.testing.assert_array_equal(a["auc_rejected"], dense[:, 0, first : first + width])
        np.testing.assert_array_equal(a["auc_accepted"], dense[:, 1, first : first + width])
    # a dense snapshot (the format before windows) restores, trimmed to the slots in use
    a = state.to_arrays()
    old = {**a, "auc_rejected": dense[:, 0], "auc_accepted": dense[:, 1]}
    del old["auc_first_slot"]
    back = CalibrationState.from_arrays(old)
    assert back.summary() == state.summary()
    assert back.to_arrays()["auc_rejected"].shape[1] < AUC_SLOTS
    # merging states with different windows adds slot by slot
    other = CalibrationState.of(
        rng.normal(-3, 0.2, (16, 4)), np.ones((16, 4), bool), np.ones((16, 4), bool)
    )
    both = state + other
    assert both.summary().count == state.summary().count + other.summary().count
