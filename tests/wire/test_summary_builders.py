"""The client's host summary builder against the core's reference, through the wire and back.

``avest_client.summary.RoundAccumulator`` (numpy, on the worker) and
``avest.core.summary.summarise`` (the service's reference) must give the same
round summary for the same steps; the wire form carries it unchanged. The
shim's torch builder is checked against the same host builder in
``tests/shim/test_shim_summary.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from avest.core.estimator import make_batch
from avest.core.model import Coefficients, linear_predictor
from avest.core.summary import summarise
from avest_client.summary import RoundAccumulator
from avest_wire.errors import InvalidInput
from avest_wire.messages import summary_from_pb, summary_to_pb
from avest_wire.summary import RoundSummary, make_summary


def _steps(n: int, k: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    truth = Coefficients.of(0.6, np.linspace(1.0, -0.8, k))
    out = []
    for _ in range(n):
        x = np.clip(rng.normal(1.5, 3.0, size=(24, k)), -40, 40)
        p = 1.0 / (1.0 + np.exp(-linear_predictor(truth, x)))
        acc = rng.random((24, k)) < p
        a = np.argmin(np.concatenate([acc, np.zeros((24, 1), bool)], axis=1), axis=1)
        d = np.minimum(a + rng.integers(0, 2, 24), k)
        out.append((x, d, a))
    return out


def _close(got: RoundSummary, want: RoundSummary) -> None:
    assert (got.version, got.k, got.steps, got.drafts) == (
        want.version,
        want.k,
        want.steps,
        want.drafts,
    )
    assert got.slope == want.slope and np.allclose(got.intercepts, want.intercepts)
    for name in ("info", "grad", "counts"):
        np.testing.assert_allclose(getattr(got, name), getattr(want, name), rtol=1e-10, atol=1e-9)
    assert got.sketch is not None and want.sketch is not None
    np.testing.assert_array_equal(got.sketch.cells, want.sketch.cells)
    np.testing.assert_array_equal(got.sketch.counts, want.sketch.counts)
    np.testing.assert_array_equal(got.sketch.ece, want.sketch.ece)
    np.testing.assert_allclose(got.sketch.psum, want.sketch.psum, rtol=1e-10)
    np.testing.assert_allclose(got.sketch.nll, want.sketch.nll, rtol=1e-10)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_host_builder_gives_the_core_reference(k: int) -> None:
    at = Coefficients.of(0.55, np.linspace(-0.3, 0.5, k))
    steps = _steps(12, k, seed=k)
    acc = RoundAccumulator(k)
    for x, d, a in steps:
        acc.add(x, d, a, at.slope, at.intercepts)
    got = acc.take(7, at.slope, at.intercepts)
    assert got is not None
    batches = [make_batch(x, d, a, k) for x, d, a in steps]
    want = summarise([(b.features, b.observed, b.accepted) for b in batches], at, 7)
    _close(got, want)


def test_a_summary_crosses_the_wire_unchanged() -> None:
    k = 5
    at = Coefficients.of(0.5, [-0.2] * k)
    acc = RoundAccumulator(k)
    for x, d, a in _steps(6, k, seed=1):
        acc.add(x, d, a, at.slope, at.intercepts)
    sent = acc.take(2, at.slope, at.intercepts)
    assert sent is not None
    back = summary_from_pb(summary_to_pb(sent), k)
    assert (back.version, back.slope, back.intercepts) == (
        sent.version,
        sent.slope,
        sent.intercepts,
    )
    np.testing.assert_array_equal(back.info, sent.info)
    assert back.drafts == sent.drafts and np.array_equal(back.counts, sent.counts)
    assert back.sketch is not None and sent.sketch is not None
    np.testing.assert_array_equal(back.sketch.cells, sent.sketch.cells)
    np.testing.assert_array_equal(back.sketch.ece, sent.sketch.ece)
    # the predicted sums travel as float32
    np.testing.assert_allclose(back.sketch.psum, sent.sketch.psum, rtol=1e-6)
    with pytest.raises(InvalidInput) as err:
        summary_from_pb(summary_to_pb(sent), k + 1)
    assert err.value.field == "summary.k"


def test_a_summary_is_checked_when_made() -> None:
    k = 3
    # two drafts a position at x = 1, p = 1/2
    good = dict(
        version=0, slope=0.5, intercepts=[0.0] * k, info=np.full((k, 3), 0.5),
        grad=np.zeros((k, 2)), counts=np.full(k, 2.0), steps=1,
    )  # fmt: skip
    assert make_summary(k, **good).drafts == 2 * k
    with pytest.raises(InvalidInput) as err:
        make_summary(k, **{**good, "counts": np.full(k, 0.5)})
    assert err.value.field == "counts"
    with pytest.raises(ValueError):  # the contract's error is a ValueError for senders
        make_summary(k, **{**good, "slope": float("nan")})
