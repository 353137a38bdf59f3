"""Round summaries: pooled sums equal raw steps; older statistics per rule; the sketch."""

from __future__ import annotations

import numpy as np
import pytest

from avest.core.calibration import Recalibrator
from avest.core.estimator import OnlineEstimator
from avest.core.metrics import CalibrationState
from avest.core.model import Coefficients, linear_predictor
from avest.core.rule_factory import make_rule
from avest.core.rules import RecursiveRule
from avest.core.stats import fold
from avest.core.summary import (
    observe_sketch,
    rebase,
    sketch_of,
    sketch_state,
    summarise,
    summary_stats,
)
from avest_wire.errors import InvalidInput
from avest_wire.summary import make_sketch, make_summary
from tests.support.steps import K, batches, synthetic_steps


@pytest.mark.parametrize("rule", ["vllm", "recursive", "tracking"])
def test_summaries_of_w_workers_give_the_raw_coefficients_and_calibration(rule):
    workers, per_round, rounds = 4, 5, 6
    steps = batches(synthetic_steps(workers * per_round * rounds))
    raw = OnlineEstimator(K, make_rule(rule), refit_interval=workers * per_round)
    pooled = OnlineEstimator(K, make_rule(rule), refit_interval=workers * per_round)
    # tracking warms up with shorter rounds: follow the raw estimator's round lengths
    it = iter(steps)
    while True:
        length = raw.round_length
        chunk = [b for _, b in zip(range(length), it, strict=False)]
        if len(chunk) < length:
            break
        at, version = pooled.coefficients, pooled.version
        for b in chunk:
            raw.apply(b)
        shards = np.array_split(np.arange(length), workers)
        for shard in shards:
            if shard.size:
                part = [(chunk[i].features, chunk[i].observed, chunk[i].accepted) for i in shard]
                pooled.apply_summary(summarise(part, at, version))
        assert pooled.version == raw.version and pooled.round == raw.round
    assert raw.round >= rounds
    np.testing.assert_allclose(
        pooled.coefficients.as_vector(), raw.coefficients.as_vector(), rtol=1e-9, atol=1e-12
    )
    a, b = pooled.calibration.summary(), raw.calibration.summary()
    assert a.count == b.count
    for name in ("auc", "logloss", "ece", "mean_predicted", "observed"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=1e-9)
    assert pooled.steps == raw.steps and pooled.drafts == raw.drafts


def _stats_at(coef, steps):
    out = None
    for b in batches(steps):
        s = fold(b.features, linear_predictor(coef, b.features), b.observed, b.accepted)
        out = s if out is None else out + s
    return out


def test_recursive_rule_is_exact_for_statistics_of_any_version():
    steps = synthetic_steps(10)
    old = Coefficients.of(0.5, [-0.2] * K)
    now = Coefficients.of(0.7, np.linspace(0.5, -1.0, K))
    stats = _stats_at(old, steps)
    first, second = RecursiveRule(), RecursiveRule()
    for rule in (first, second):  # the same prior centre (the pair's start)
        rule.reset(Coefficients.cold_start(K))
    # The worker's own round, refitted where it was computed ...
    direct = first.refit(old, stats).coefficients.as_vector()
    # ... equals the same sums moved to the current point, refitted there.
    moved = second.refit(now, rebase(stats, old, now)).coefficients.as_vector()
    np.testing.assert_allclose(moved, direct, rtol=1e-12, atol=1e-12)


def test_rebase_moves_the_gradient_to_first_order():
    steps = synthetic_steps(10)
    old = Coefficients.of(0.5, [-0.2] * K)
    now = Coefficients.of(0.5 + 1e-3, np.full(K, -0.2 + 1e-3))
    far = Coefficients.of(0.5 + 1e-2, np.full(K, -0.2 + 1e-2))
    stats = _stats_at(old, steps)
    errs = []
    for to in (now, far):
        truth = _stats_at(to, steps)
        got = rebase(stats, old, to)
        errs.append(float(np.abs(got.g1 - truth.g1).max()))
        # without the correction the error is first order
        assert np.abs(stats.g1 - truth.g1).max() > 10 * errs[-1]
    assert errs[1] / errs[0] > 50  # quadratic: 10x the move, ~100x the error


def test_stale_summary_is_rebased_by_the_estimator():
    steps = batches(synthetic_steps(8))
    est = OnlineEstimator(K, RecursiveRule(), refit_interval=4)
    at, version = est.coefficients, est.version
    parts = [(b.features, b.observed, b.accepted) for b in steps]
    est.apply_summary(summarise(parts[:4], at, version))  # refits: version moves on
    assert est.version == version + 1
    before = est.round_stats.g1.copy()
    late = summarise(parts[4:], at, version)
    est.apply_summary(late)
    expected = rebase(summary_stats(late), at, est.coefficients)
    # the round got the moved gradient, then refitted; compare the refit's input
    assert est.round == 2
    assert np.allclose(before, 0.0)
    assert not np.allclose(expected.g1, summary_stats(late).g1)


def _good(**over):
    kw = dict(
        version=0,
        slope=0.5,
        intercepts=[-0.2] * K,
        info=np.full((K, 3), 0.5),  # two drafts a position at x = 1, p = 1/2
        grad=np.zeros((K, 2)),
        counts=np.full(K, 2.0),
        steps=3,
        drafts=2 * K,
    )
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over,field",
    [
        ({"drafts": 3}, "drafts"),
        ({"counts": np.full(K, 1.5)}, "counts"),
        ({"counts": np.full(K, -1.0), "drafts": -K}, "counts"),
        ({"steps": 0}, "steps"),
        ({"info": np.ones((K, 2))}, "info"),
        ({"info": -np.ones((K, 3))}, "info"),
        ({"grad": np.full((K, 2), np.nan)}, "grad"),
        ({"slope": -0.1}, "slope"),
        ({"intercepts": [0.0] * (K + 1)}, "intercepts"),
        ({"sketch": sketch_of(CalibrationState.empty(K))}, "sketch"),
    ],
)
def test_malformed_summaries_are_refused_naming_the_field(over, field):
    with pytest.raises(InvalidInput) as err:
        make_summary(K, **_good(**over))
    assert err.value.field == field


def test_refused_summary_leaves_the_estimator_untouched():
    est = OnlineEstimator(K, RecursiveRule(), refit_interval=4)
    snap = est.snapshot()
    with pytest.raises(InvalidInput):
        est.apply_summary(make_summary(K, **_good(drafts=1)))
    assert all(np.array_equal(v, est.snapshot()[n]) for n, v in snap.items())


def test_sketch_round_trips_through_its_sparse_cells():
    b = batches(synthetic_steps(6))
    at = Coefficients.cold_start(K)
    sk = summarise([(x.features, x.observed, x.accepted) for x in b], at, 0).sketch
    assert sk is not None
    state = sketch_state(sk)
    arrays = state.to_arrays()
    parts = [
        arrays[n] for n in ("ece_rejected", "ece_accepted", "ece_sum_predicted", "logloss_sum")
    ]
    back = sketch_state(make_sketch(K, sk.cells, sk.counts, *parts))
    assert all(np.array_equal(v, back.to_arrays()[n]) for n, v in arrays.items())
    with pytest.raises(InvalidInput) as err:
        make_sketch(K, sk.cells[::-1], sk.counts, *parts)
    assert err.value.field == "cell_deltas"
    bad = arrays["ece_rejected"].copy()
    bad[0, 0] += 1
    with pytest.raises(InvalidInput) as err:
        make_sketch(K, sk.cells, sk.counts, bad, *parts[1:])
    assert err.value.field == "cell_counts"
    with pytest.raises(InvalidInput) as err:
        make_sketch(K, sk.cells, sk.counts, *parts[:2], parts[2] + 1e3, parts[3])
    assert err.value.field == "ece_sum_predicted"


def _layers_fed_by_drafts_and_by_sketches() -> tuple[Recalibrator, Recalibrator]:
    """Two calibration layers fed the same 40 steps, four rounds: one draft by draft,
    one from the rounds' sketches."""
    b = batches(synthetic_steps(40, rows=64))
    at = Coefficients.of(0.3, [0.4] * K)  # miscalibrated on purpose
    by_draft, by_sketch = Recalibrator(), Recalibrator()
    for chunk in range(0, 40, 10):
        part = [(x.features, x.observed, x.accepted) for x in b[chunk : chunk + 10]]
        for x, obs, acc in part:
            by_draft.observe(linear_predictor(at, x), obs, acc)
        s = summarise(part, at, 0)
        assert s.sketch is not None
        observe_sketch(by_sketch, s.sketch)
        by_draft.refit()
        by_sketch.refit()
    return by_draft, by_sketch


def test_calibration_layer_learns_from_sketches_as_from_drafts():
    by_draft, by_sketch = _layers_fed_by_drafts_and_by_sketches()
    np.testing.assert_allclose(by_sketch.total, by_draft.total, rtol=0.02, atol=4.0)
    np.testing.assert_allclose(by_sketch.table, by_draft.table, atol=0.05)
    assert by_sketch.active == by_draft.active


def test_sketches_feed_the_serving_test_as_drafts_do():
    """The layer's serving test (loss and its spread) from sketches matches the
    same drafts scored one by one, so summary mode serves on evidence, not by default."""
    by_draft, by_sketch = _layers_fed_by_drafts_and_by_sketches()
    assert by_sketch.spread[1] == pytest.approx(by_draft.spread[1])
    assert by_sketch.spread[0] > 0
    assert by_sketch.spread[0] == pytest.approx(by_draft.spread[0], rel=0.1)
    mapped, plain = by_sketch.recent_logloss
    assert np.isfinite(mapped) and np.isfinite(plain)
    assert mapped == pytest.approx(by_draft.recent_logloss[0], abs=0.01)
