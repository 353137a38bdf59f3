"""The summary builders never produce a summary the contract's bounds refuse.

For random rounds of valid steps (features anywhere in the clamp, often at
``+-40`` or 0; any verified and accepted drafts; coefficients from 0 to extreme),
the host builder (``avest_client.summary.RoundAccumulator``, float64) and the
shim's device round (``avest_client.vllm.rounds.SummaryRound`` over vLLM's float32
sums, here the CPU stand-in's, and its float32 sketch) give summaries that
``make_summary`` accepts and that the service's one-pass check takes off the wire.
The degenerate rounds that sit on a bound (every ``p = 1/2``, every draft at the
clamp and wrong, one draft a position) are drawn explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from avest_client.summary import RoundAccumulator
from avest_client.vllm.rounds import SummaryRound
from avest_wire.limits import MAX_LOG_ODDS
from avest_wire.messages import intake_pb, summary_to_pb
from avest_wire.summary import RoundSummary
from tests.support.standin import StandinAcceptanceEstimator

CPU = torch.device("cpu")
#: Examples per builder: each is a round of a few steps (the device one on a thread).
EXAMPLES = 80
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Round:
    """One round of a worker: ``features`` [T, R, K] (float32, as the device holds
    them), ``verified`` and ``accepted`` [T, R], scored at ``slope``, ``intercepts``."""

    features: np.ndarray
    verified: np.ndarray
    accepted: np.ndarray
    slope: float
    intercepts: tuple[float, ...]

    @property
    def k(self) -> int:
        return int(self.features.shape[2])


#: Features at the clamp and at 0 are where the bounds are met with equality.
EDGES = [-MAX_LOG_ODDS, MAX_LOG_ODDS, 0.0, 1.0]
FEATURE = st.one_of(
    st.sampled_from(EDGES),
    st.floats(-MAX_LOG_ODDS, MAX_LOG_ODDS, allow_nan=False, width=32),
)
SLOPE = st.one_of(
    st.sampled_from([0.0, 1e-6, 0.5, 50.0, 1e3]),
    st.floats(0.0, 1e3, allow_nan=False),
)
INTERCEPT = st.one_of(
    st.sampled_from([0.0, -30.0, 30.0, -0.2]),
    st.floats(-60.0, 60.0, allow_nan=False),
)


@st.composite
def rounds(draw: st.DrawFn) -> Round:
    k = draw(st.integers(1, 6))
    steps = draw(st.integers(1, 5))
    rows = draw(st.integers(1, 12))
    x = draw(arrays(np.float32, (steps, rows, k), elements=FEATURE))
    verified = draw(arrays(np.int64, (steps, rows), elements=st.integers(0, k)))
    accepted = np.minimum(
        draw(arrays(np.int64, (steps, rows), elements=st.integers(0, k))), verified
    )
    b = draw(st.lists(INTERCEPT, min_size=k, max_size=k))
    return Round(x, verified, accepted, draw(SLOPE), tuple(b))


def _uniform(k: int, steps: int, rows: int, x: float, slope: float, b: float, a: int) -> Round:
    """Every draft alike: feature ``x``, ``a`` accepted of ``k`` verified."""
    return Round(
        np.full((steps, rows, k), x, dtype=np.float32),
        np.full((steps, rows), k),
        np.full((steps, rows), a),
        slope,
        (b,) * k,
    )


#: Every p = 1/2: c_k = counts_k / 4 exactly, and |b_k| = sqrt(a_k c_k) (one feature).
HALF = _uniform(3, 4, 8, 0.7, 0.0, 0.0, 1)
#: Every draft at the clamp, predicted rejected and accepted: |g1_k| = counts_k and
#: the log loss is counts_k x softplus(slope x 40 + |b_k|) (up to float rounding).
WRONG_AT_THE_CLAMP = _uniform(2, 3, 8, -MAX_LOG_ODDS, 1.0, -1.0, 2)
#: One draft a position: |b_k| = sqrt(a_k c_k) for every position.
ONE_DRAFT = _uniform(4, 1, 1, 13.25, 0.9, 0.4, 4)


def with_edges(test: Callable[[Round], None]) -> Callable[[], None]:
    """``test`` over random rounds, the three degenerate ones always among them."""
    for edge in (ONE_DRAFT, WRONG_AT_THE_CLAMP, HALF):
        test = example(r=edge)(test)
    return PROPERTY(given(r=rounds())(test))  # type: ignore[no-any-return]


def _fast_accepts(summary: RoundSummary) -> bool:
    """Whether the service's one-pass check takes the summary off the wire as it is."""
    msg = summary_to_pb(summary)
    return intake_pb(msg, summary.k, with_sketch=msg.HasField("sketch")) is not None


@with_edges
def test_the_host_builder_stays_within_the_bounds(r: Round) -> None:
    acc = RoundAccumulator(r.k)
    for x, d, a in zip(r.features, r.verified, r.accepted, strict=True):
        acc.add(x.astype(np.float64), d, a, r.slope, r.intercepts)
    summary = acc.take(1, r.slope, r.intercepts)  # make_summary: raises if refused
    assert summary is not None
    assert _fast_accepts(summary)


class _Sink:
    def __init__(self) -> None:
        self.summaries: list[RoundSummary] = []

    def submit_summary(self, summary: RoundSummary) -> None:
        self.summaries.append(summary)


def _device_round(r: Round) -> RoundSummary:
    """The round as the shim sends it: vLLM's float32 sums (the stand-in's) and the
    float32 sketch, through :class:`SummaryRound` as the shim drives it."""
    steps, rows, k = r.features.shape
    est = StandinAcceptanceEstimator(rows, k, CPU)
    est.REFIT_INTERVAL = steps + 1  # pooled coefficients govern: no local refit
    # the shim applies pooled coefficients to vLLM's float32 tensors
    est.slope.fill_(r.slope)
    est.intercepts.copy_(torch.tensor(r.intercepts, dtype=torch.float32))
    sink = _Sink()
    rnd = SummaryRound(sink, k, CPU, max_num_reqs=rows, round_steps=steps)
    try:
        rnd.start(1, r.slope, r.intercepts)
        for x, d, a in zip(r.features, r.verified, r.accepted, strict=True):
            idx = torch.arange(rows)  # fresh tensors every step, as vLLM allocates them
            sampled = torch.from_numpy((a + 1).astype(np.int32))
            rejected = torch.from_numpy((d - a).astype(np.int32))
            est.load_features(idx, torch.from_numpy(x.copy()))
            rnd.record(est, idx, sampled, rejected)
            est.step(idx, sampled, rejected)
            rnd.steps += 1
        rnd.end(est)
        assert rnd.flush(timeout=120), "the sender did not hand the round over"
    finally:
        rnd.close(timeout=30)
    assert rnd.send_errors == 0, "make_summary refused the device round"
    (summary,) = sink.summaries
    assert summary.sketch is not None
    return summary


@with_edges
def test_the_device_builder_stays_within_the_bounds(r: Round) -> None:
    assert _fast_accepts(_device_round(r))


def test_the_degenerate_rounds_sit_on_their_bounds() -> None:
    """The explicit examples above do reach the bounds (else they would test nothing)."""
    half = _device_round(HALF)
    np.testing.assert_array_equal(half.info[:, 2], half.counts / 4)
    wrong = _device_round(WRONG_AT_THE_CLAMP)
    assert wrong.sketch is not None
    np.testing.assert_allclose(np.abs(wrong.grad[:, 1]), wrong.counts, rtol=1e-6)
    e = wrong.slope * MAX_LOG_ODDS + np.abs(np.asarray(wrong.intercepts))
    most = wrong.counts * (e + np.log1p(np.exp(-e)))
    np.testing.assert_allclose(wrong.sketch.nll, most, rtol=1e-6)
    one = _device_round(ONE_DRAFT)
    a, b, c = one.info.T
    np.testing.assert_allclose(np.abs(b), np.sqrt(a * c), rtol=1e-6)


def test_a_summary_message_without_a_sketch_is_accepted_alike() -> None:
    acc = RoundAccumulator(2, sketch=False)
    acc.add(np.full((3, 2), MAX_LOG_ODDS), [2, 2, 1], [0, 2, 1], 0.5, (-0.2, 0.1))
    summary = acc.take(0, 0.5, (-0.2, 0.1))
    assert summary is not None and summary.sketch is None
    assert _fast_accepts(summary)
