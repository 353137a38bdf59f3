"""Round summaries no round can produce are refused, naming the field and the position.

Each sum of a summary is bounded by its definition and the feature clamp
(``avest_wire.summary.SUM_BOUNDS``, the ECE and log-loss bounds): a summary past a
bound by more than the float slack is refused by the builders' check
(``make_summary``) and on the wire, where the one-pass ``intake`` leaves it to the
thorough checks; a summary within the slack passes both, with equal arrays.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from avest_client.summary import RoundAccumulator
from avest_wire.bins import ECE_BINS
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_LOG_ODDS
from avest_wire.messages import intake_pb, summary_from_checked_pb, summary_from_pb, summary_to_pb
from avest_wire.summary import BOUND_REL_SLACK, RoundSummary, make_summary
from avest_wire.v1 import estimator_pb2 as pb

K = 4
#: The position every corruption below is made at (any position but the first: the
#: refusal must name it).
POS = 1
SLOPE, INTERCEPTS = 0.6, (0.3, -0.1, -0.5, -1.2)


def _base() -> RoundSummary:
    """An honest round of 8 steps of 16 requests, built on the host."""
    rng = np.random.default_rng(3)
    acc = RoundAccumulator(K)
    for _ in range(8):
        x = np.clip(rng.normal(2.0, 6.0, size=(16, K)), -MAX_LOG_ODDS, MAX_LOG_ODDS)
        a = rng.integers(0, K + 1, 16)
        acc.add(x, np.full(16, K), a, SLOPE, INTERCEPTS)
    out = acc.take(2, SLOPE, INTERCEPTS)
    assert out is not None and out.counts[POS] > 0
    return out


def _fast(msg: pb.RoundSummary) -> RoundSummary | None:
    """The one-pass check on a message, as ``summary_from_pb`` runs it first."""
    return intake_pb(msg, K, with_sketch=True)


def _softplus(e: float) -> float:
    return e + float(np.log1p(np.exp(-e)))


def _set_info(col: int, value: Callable[[pb.RoundSummary], float]):
    def mutate(m: pb.RoundSummary) -> None:
        m.info[3 * POS + col] = value(m)

    return mutate


def _set_grad(col: int, value: Callable[[pb.RoundSummary], float]):
    def mutate(m: pb.RoundSummary) -> None:
        m.grad[2 * POS + col] = value(m)

    return mutate


def _n(m: pb.RoundSummary) -> float:
    return m.counts[POS]


def _sqrt_ac(m: pb.RoundSummary) -> float:
    return float(np.sqrt(m.info[3 * POS] * m.info[3 * POS + 2]))


def _busy_bin(m: pb.RoundSummary) -> tuple[int, float]:
    """The flat index of a bin of ``POS`` past the first that holds drafts, and its drafts."""
    sk = m.sketch
    for j in range(1, ECE_BINS):
        i = POS * ECE_BINS + j
        drafts = sk.ece_rejected[i] + sk.ece_accepted[i]
        if drafts:
            return i, float(drafts)
    raise AssertionError("no busy bin")


def _set_psum(scale: Callable[[int, float], float]):
    """``ece_sum_predicted`` of the busy bin set to ``scale(bin, drafts)``."""

    def mutate(m: pb.RoundSummary) -> None:
        i, drafts = _busy_bin(m)
        m.sketch.ece_sum_predicted[i] = scale(i % ECE_BINS, drafts)

    return mutate


def _most_loss(m: pb.RoundSummary) -> float:
    return _n(m) * _softplus(m.slope * MAX_LOG_ODDS + abs(m.intercepts[POS]))


def _set_nll(value: Callable[[pb.RoundSummary], float]):
    def mutate(m: pb.RoundSummary) -> None:
        m.sketch.logloss_sum[POS] = value(m)

    return mutate


#: ``(mutate(message, factor), field, words of the problem)``: each bound pushed to
#: ``factor`` times its value; refused at ``1 + 2 slack``, accepted at ``1 + slack / 2``.
BOUNDS = {
    "c_k above counts/4": (
        lambda f: _set_info(2, lambda m: f * _n(m) / 4),
        "summary.info",
        "c_k",
    ),
    "a_k above counts*40^2/4": (
        lambda f: _set_info(0, lambda m: f * _n(m) * MAX_LOG_ODDS**2 / 4),
        "summary.info",
        "a_k",
    ),
    "b_k above sqrt(a_k c_k)": (
        lambda f: _set_info(1, lambda m: -f * _sqrt_ac(m)),
        "summary.info",
        "positive semidefinite",
    ),
    "g0_k above counts*40": (
        lambda f: _set_grad(0, lambda m: f * _n(m) * MAX_LOG_ODDS),
        "summary.grad",
        "g0_k",
    ),
    "g1_k below -counts": (
        lambda f: _set_grad(1, lambda m: -f * _n(m)),
        "summary.grad",
        "g1_k",
    ),
    "log loss above the coefficients' most": (
        lambda f: _set_nll(lambda m: f * _most_loss(m)),
        "sketch.logloss_sum",
        "exceeds",
    ),
    "predictions above the bin's top": (
        lambda f: _set_psum(lambda j, d: f * d * (j + 1) / ECE_BINS),
        "sketch.ece_sum_predicted",
        "lies outside",
    ),
    "predictions below the bin's bottom": (
        # the slack on either side of a bin is relative to its top
        lambda f: _set_psum(lambda j, d: d * (j - (f - 1) * (j + 1)) / ECE_BINS),
        "sketch.ece_sum_predicted",
        "lies outside",
    ),
}


def _predict_past_the_first_bin(m: pb.RoundSummary) -> None:
    """The first bin (p below 1/15) of ``m`` drafts predicting one more than ``m / 15``."""
    sk, i = m.sketch, POS * ECE_BINS
    sk.ece_sum_predicted[i] = (sk.ece_rejected[i] + sk.ece_accepted[i]) / ECE_BINS + 1.0


#: Summaries an outside probe got accepted, and values far past each bound.
FORGED = {
    "|g1_k| above counts": (_set_grad(1, lambda m: _n(m) + 2.0), "summary.grad", "g1_k"),
    "c_k = 1e300": (_set_info(2, lambda m: 1e300), "summary.info", "c_k"),
    "|b_k| above counts*40/4": (
        _set_info(1, lambda m: 11.0 * _n(m)),
        "summary.info",
        "|b_k|",
    ),
    "information not PSD": (
        _set_info(1, lambda m: 2.0 * _sqrt_ac(m)),
        "summary.info",
        "positive semidefinite",
    ),
    "log loss 1e308": (_set_nll(lambda m: 1e308), "sketch.logloss_sum", "exceeds"),
    "log loss below 0": (_set_nll(lambda m: -1.0), "sketch.logloss_sum", "below 0"),
    "predictions past the first bin": (
        _predict_past_the_first_bin,
        "sketch.ece_sum_predicted",
        "outside",
    ),
}


def _refused(msg: pb.RoundSummary, field: str, words: str) -> None:
    assert _fast(msg) is None
    with pytest.raises(InvalidInput) as err:
        summary_from_pb(msg, K)
    assert err.value.field == field
    assert f"position {POS}" in err.value.problem and words in err.value.problem


@pytest.mark.parametrize("name", sorted(FORGED))
def test_a_forged_summary_is_refused_on_the_wire_naming_field_and_position(name: str) -> None:
    mutate, field, words = FORGED[name]
    msg = summary_to_pb(_base())
    mutate(msg)
    _refused(msg, field, words)


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_each_bound_holds_up_to_its_slack_on_both_paths(name: str) -> None:
    make, field, words = BOUNDS[name]
    inside = summary_to_pb(_base())
    make(1.0 + BOUND_REL_SLACK / 2)(inside)
    fast = _fast(inside)
    assert fast is not None
    thorough = summary_from_pb(inside, K)
    for part in ("info", "grad", "counts"):
        assert np.array_equal(getattr(fast, part), getattr(thorough, part))
    assert fast.sketch is not None and thorough.sketch is not None
    assert np.array_equal(fast.sketch.psum, thorough.sketch.psum)
    assert np.array_equal(fast.sketch.nll, thorough.sketch.nll)
    outside = summary_to_pb(_base())
    make(1.0 + 2 * BOUND_REL_SLACK)(outside)
    _refused(outside, field, words)


def _sums(s: RoundSummary) -> dict[str, object]:
    return dict(
        version=s.version, slope=s.slope, intercepts=s.intercepts, info=s.info.copy(),
        grad=s.grad.copy(), counts=s.counts, steps=s.steps, sketch=s.sketch,
    )  # fmt: skip


def test_the_builders_check_refuses_what_the_wire_refuses() -> None:
    """``make_summary`` (what the client and the shim build through) names the same field."""
    base = _base()
    kw = _sums(base)
    kw["grad"][POS, 1] = base.counts[POS] + 2.0  # type: ignore[index]
    with pytest.raises(InvalidInput) as err:
        make_summary(K, **kw)  # type: ignore[arg-type]
    assert err.value.field == "grad" and f"position {POS}" in err.value.problem
    kw = _sums(base)
    kw["info"][POS, 2] = 1e300  # type: ignore[index]
    with pytest.raises(InvalidInput) as err:
        make_summary(K, **kw)  # type: ignore[arg-type]
    assert err.value.field == "info" and "c_k" in err.value.problem
    kw = _sums(base)
    kw["sketch"] = None  # without a sketch only the sums are bounded
    assert make_summary(K, **kw).drafts == base.drafts  # type: ignore[arg-type]


def test_a_position_without_drafts_carries_no_sums() -> None:
    """``counts_k = 0`` bounds every sum of the position to 0 (up to the absolute slack)."""
    k = 2
    good = dict(
        version=0, slope=0.5, intercepts=[0.0, 0.0], info=[[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]],
        grad=[[0.0, 0.0], [0.0, 0.0]], counts=[2.0, 0.0], steps=1,
    )  # fmt: skip
    assert make_summary(k, **good).drafts == 2  # type: ignore[arg-type]
    with pytest.raises(InvalidInput) as err:
        make_summary(k, **{**good, "grad": [[0.0, 0.0], [0.0, 0.01]]})  # type: ignore[arg-type]
    assert err.value.field == "grad" and "position 1" in err.value.problem


@pytest.mark.parametrize("with_sketch", [True, False])
def test_a_checked_message_reads_back_the_same_without_its_checks(with_sketch: bool) -> None:
    """What a replica stored after checking it (``summary_from_pb``) reads back with
    ``summary_from_checked_pb`` to the very same summary, checks not run again."""
    msg = summary_to_pb(_base())
    if not with_sketch:
        msg.ClearField("sketch")
    checked = summary_from_pb(msg, K)
    again = summary_from_checked_pb(pb.RoundSummary.FromString(msg.SerializeToString()), K)
    for name in ("version", "slope", "intercepts", "steps", "drafts"):
        assert getattr(again, name) == getattr(checked, name), name
    for name in ("info", "grad", "counts"):
        np.testing.assert_array_equal(getattr(again, name), getattr(checked, name))
    if not with_sketch:
        assert again.sketch is None and checked.sketch is None
        return
    assert again.sketch is not None and checked.sketch is not None
    for name in ("cells", "counts", "ece", "psum", "nll"):
        np.testing.assert_array_equal(getattr(again.sketch, name), getattr(checked.sketch, name))
    np.testing.assert_array_equal(
        again.sketch.drafts_per_position(), checked.sketch.drafts_per_position()
    )
    # the checks are not run: a forged row reads as stored (only replicas write the log)
    forged = pb.RoundSummary.FromString(msg.SerializeToString())
    forged.slope = -1.0
    assert summary_from_checked_pb(forged, K).slope == -1.0
    with pytest.raises(InvalidInput):
        summary_from_pb(forged, K)
