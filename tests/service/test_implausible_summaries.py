"""Round summaries no worker's round can produce are refused by the service.

Through the real gRPC server: each forged summary (sums past the bounds their
definitions set, a log loss of 1e308, predictions outside their bins) ends the
Observe stream with INVALID_ARGUMENT naming the field and the position, is counted
as refused, and leaves the pair as it was: coefficients, round, drafts and steps
observed, calibration, also after a restart from its SQLite store. The same
message unforged is then accepted and moves the pair.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from avest.metrics import names as N
from avest_client.summary import RoundAccumulator
from avest_wire.bins import ECE_BINS
from avest_wire.limits import MAX_LOG_ODDS
from avest_wire.messages import summary_to_pb
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import Live, observe, register
from tests.support.metrics import scrape, value

K = 3
#: The position each forgery is made at: the refusal must name it.
POS = 1
#: The live servers' refit interval: an accepted summary of this many steps refits.
ROUND_STEPS = 10


def _honest(live: Live, pid: str, seed: int) -> pb.RoundSummary:
    """A worker's round of ``ROUND_STEPS`` steps at the pair's coefficients."""
    c = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid), timeout=10).coefficients
    rng = np.random.default_rng(seed)
    acc = RoundAccumulator(K)
    for _ in range(ROUND_STEPS):
        x = np.clip(rng.normal(1.0, 5.0, size=(12, K)), -MAX_LOG_ODDS, MAX_LOG_ODDS)
        acc.add(x, np.full(12, K), rng.integers(0, K + 1, 12), c.slope, c.intercepts)
    summary = acc.take(c.version, c.slope, c.intercepts)
    assert summary is not None and summary.counts[POS] > 0
    return summary_to_pb(summary)


def _send(live: Live, pid: str, seq: int, summary: pb.RoundSummary) -> int:
    msg = pb.ObserveRequest(pair_id=pid, worker_id="w0", sequence=seq, summary=summary)
    return observe(live, [msg])


def _pair(live: Live, pid: str) -> tuple[object, ...]:
    """What a summary would change of the pair, as ``GetPair`` reads it."""
    p = live.stub.GetPair(pb.GetPairRequest(pair_id=pid), timeout=10).pair
    c, cal = p.coefficients, p.calibration
    return (
        c.version, c.round, c.slope, tuple(c.intercepts), p.drafts_observed,
        p.steps_observed, cal.count, cal.logloss, cal.auc, cal.ece,
    )  # fmt: skip


def _n(m: pb.RoundSummary) -> float:
    return m.counts[POS]


def _set(part: Callable[[pb.RoundSummary], object], i: int, v: Callable[[pb.RoundSummary], float]):
    def forge(m: pb.RoundSummary) -> None:
        part(m)[i] = v(m)  # type: ignore[index]

    return forge


def _info(m: pb.RoundSummary) -> object:
    return m.info


def _grad(m: pb.RoundSummary) -> object:
    return m.grad


def _logloss(m: pb.RoundSummary) -> object:
    return m.sketch.logloss_sum


def _psd_breach(m: pb.RoundSummary) -> float:
    return 2.0 * float(np.sqrt(m.info[3 * POS] * m.info[3 * POS + 2])) + 1.0


def _predict_past_the_first_bin(m: pb.RoundSummary) -> None:
    """The first bin (p below 1/15) of ``m`` drafts predicting one more than ``m / 15``."""
    sk, i = m.sketch, POS * ECE_BINS
    sk.ece_sum_predicted[i] = (sk.ece_rejected[i] + sk.ece_accepted[i]) / ECE_BINS + 1.0


#: name: (forge the message, the field the refusal names)
FORGED: dict[str, tuple[Callable[[pb.RoundSummary], None], str]] = {
    "|g1_k| above counts_k": (_set(_grad, 2 * POS + 1, lambda m: _n(m) + 5.0), "summary.grad"),
    "|g0_k| above 40 counts_k": (_set(_grad, 2 * POS, lambda m: -41.0 * _n(m)), "summary.grad"),
    "c_k = 1e300": (_set(_info, 3 * POS + 2, lambda m: 1e300), "summary.info"),
    "a_k above 40^2/4 counts_k": (_set(_info, 3 * POS, lambda m: 401.0 * _n(m)), "summary.info"),
    "information not PSD": (_set(_info, 3 * POS + 1, _psd_breach), "summary.info"),
    "log loss 1e308": (_set(_logloss, POS, lambda m: 1e308), "sketch.logloss_sum"),
    "log loss below 0": (_set(_logloss, POS, lambda m: -1.0), "sketch.logloss_sum"),
    "predictions past the first bin": (_predict_past_the_first_bin, "sketch.ece_sum_predicted"),
}


def test_forged_summaries_are_refused_and_leave_the_pair_as_it_was(
    open_server: Callable[..., Live],
) -> None:
    live = open_server(refit_interval=ROUND_STEPS)
    pairs: dict[str, str] = {}
    before: dict[str, tuple[object, ...]] = {}
    honest: dict[str, pb.RoundSummary] = {}
    for i, name in enumerate(sorted(FORGED)):
        pid = pairs[name] = register(live, k=K, refit_interval=ROUND_STEPS, target=f"t{i}")
        assert _send(live, pid, 1, _honest(live, pid, seed=i)) == 1  # a refit: version 1
        before[name] = _pair(live, pid)
        assert before[name][0] == 1
        honest[name] = _honest(live, pid, seed=100 + i)
        forge, field = FORGED[name]
        forged = pb.RoundSummary()
        forged.CopyFrom(honest[name])
        forge(forged)
        with pytest.raises(grpc.RpcError) as err:
            _send(live, pid, 2, forged)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        details = err.value.details() or ""
        assert f"{field}: position {POS}" in details, (name, details)
        assert _pair(live, pid) == before[name], name
    samples = scrape(live)
    refused = value(samples, N.REFUSED_BATCHES, method="Observe", reason="invalid_argument")
    assert refused == len(FORGED)

    # the store holds the pairs as they were
    live.stop()
    live = open_server(refit_interval=ROUND_STEPS)
    for name, pid in pairs.items():
        assert _pair(live, pid) == before[name], name

    # the same rounds unforged are pooled: the refusals were the forgeries'
    for name, pid in pairs.items():
        assert _send(live, pid, 2, honest[name]) == 2
        after = _pair(live, pid)
        assert after[0] == 2 and after[4] > before[name][4], name  # refitted, drafts pooled
