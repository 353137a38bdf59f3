"""The per-pair collector: every pair's gauges and totals, read on each scrape.

Reading the registry at scrape time (rather than updating gauges as the state
changes) means each pair's series exist from its registration (or restoration
from the store) on, before any observation, and cost nothing between scrapes.

On replicas (:mod:`avest.state.replicas`) every replica holds every pair, but a
pair's series are exported by its refitter alone (:func:`exported`), so a pair's
series summed over the replicas count it once; at a fail-over they move to the
replica that takes the pair over, hence read them aggregated ``by (pair)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from avest import __version__
from avest.core.metrics import CalibrationSummary, Reliability
from avest.core.rules import OUTCOMES
from avest.metrics import names


class PairSource(Protocol):
    """What the collector reads on a scrape (the service's :class:`~avest.metrics.registry.Metrics`)."""

    app: Any
    open_streams: Callable[[], int]

    def summary(self, pair: Any) -> CalibrationSummary: ...

    def recent_summary(self, pair: Any) -> CalibrationSummary: ...

    def refit_counts(self, pair_id: str) -> dict[str, int]: ...

    def reliability(self, pair: Any) -> Reliability: ...


#: The families this collector exposes, in exposition order.
COLLECTED = (
    names.INFO,
    names.PAIRS,
    names.PAIR_INFO,
    names.SLOPE,
    names.INTERCEPT,
    names.COEFFICIENTS_VERSION,
    names.ROUND,
    names.STRATUM_SLOPE,
    names.STRATUM_DRAFTS,
    names.STRATUM_ECE,
    names.STRATUM_LOG_LOSS,
    names.STRATA_FALLBACK_ROWS,
    names.SCHEDULE_GOODPUT,
    names.SCHEDULE_LENGTH,
    names.AUC,
    names.ECE,
    names.LOG_LOSS,
    names.CALIBRATION_DRAFTS,
    names.PREDICTED_ACCEPTANCE,
    names.OBSERVED_ACCEPTANCE,
    names.RECENT_AUC,
    names.RECENT_ECE,
    names.RECENT_LOG_LOSS,
    names.RECENT_PREDICTED_ACCEPTANCE,
    names.RECENT_OBSERVED_ACCEPTANCE,
    names.LAST_OBSERVED,
    names.DRAFTS_OBSERVED,
    names.STEPS_OBSERVED,
    names.REFITS,
    names.REPLICA_INFO,
    names.REPLICA_PAIRS_REFITTED,
    names.REPLICAS_LIVE,
    names.PENDING_FOLDED,
    names.PENDING_DROPPED,
    names.OPEN_STREAMS,
    names.OVERLOADED,
    names.ADMISSION_QUEUED,
    names.BACKPRESSURE_WAITS,
    names.QUEUE_DEPTH,
    names.STORE_ERRORS,
    names.STORE_WRITABLE,
    names.QUARANTINED_PAIRS,
    names.PREDICTED_SURVIVAL,
    names.OBSERVED_SURVIVAL,
    names.RELIABILITY_DRAFTS,
    names.RELIABILITY_PREDICTED,
    names.RELIABILITY_OBSERVED,
    names.CALIBRATION_LAYER_SERVED,
    names.CALIBRATION_LAYER_GAIN,
)

Families = dict[str, GaugeMetricFamily | CounterMetricFamily]


class PairCollector:
    """Reads the registry on each scrape: every pair's gauges and totals.

    ``collect()`` runs on the event loop (it reads the live state) and returns
    families whose samples are copies: the exposition renders them on a thread
    (:meth:`avest.metrics.registry.Metrics.exposition_async`).
    """

    def __init__(self, metrics: PairSource) -> None:
        self._metrics = metrics

    def families(self) -> Families:
        out: Families = {}
        for name in COLLECTED:
            spec = names.SPECS[name]
            if spec.kind == "counter":
                out[name] = CounterMetricFamily(
                    names.family_name(name), spec.help, labels=list(spec.labels)
                )
            else:
                out[name] = GaugeMetricFamily(name, spec.help, labels=list(spec.labels))
        return out

    def describe(self) -> Iterable[Metric]:
        return list(self.families().values())

    def pairs(self) -> list[Any]:
        return exported(self._metrics.app)

    def collect(self) -> Iterable[Metric]:
        f = self.families()
        pairs = self.pairs()
        self.add_globals(f, pairs, sum(map(self.tally, pairs)))
        for pair in pairs:
            self.add_pair(f, pair)
        return list(f.values())

    def tally(self, pair: Any) -> float:
        """A pair's share of the global series, read on every scrape (its stamp
        does not move when its steps become durable): its queue depth."""
        return float(queue_depth(pair.applied, pair.durable))

    def add_globals(self, f: Families, pairs: list[Any], tallied: float) -> None:
        """The samples that are not per pair (``tallied``: the pairs' tallies summed)."""
        m = self._metrics
        f[names.INFO].add_metric([__version__], 1.0)
        f[names.OPEN_STREAMS].add_metric([], float(m.open_streams()))
        app = m.app
        admission = app.admission
        f[names.OVERLOADED].add_metric([], 1.0 if admission.full else 0.0)
        f[names.ADMISSION_QUEUED].add_metric([], float(admission.waiting))
        f[names.BACKPRESSURE_WAITS].add_metric([], float(admission.waited))
        for operation, count in getattr(app, "store_errors", {}).items():
            f[names.STORE_ERRORS].add_metric([operation], float(count))
        f[names.STORE_WRITABLE].add_metric([], 0.0 if getattr(app, "store_error", "") else 1.0)
        f[names.QUARANTINED_PAIRS].add_metric([], float(len(getattr(app, "quarantined", {}))))
        replication = getattr(app, "replication", None)
        if replication is not None:
            f[names.REPLICA_INFO].add_metric([replication.name], 1.0)
            f[names.REPLICA_PAIRS_REFITTED].add_metric([], float(len(replication.led)))
            f[names.REPLICAS_LIVE].add_metric([], float(replication.live))
            f[names.PENDING_FOLDED].add_metric([], float(replication.folded_rows))
            f[names.PENDING_DROPPED].add_metric([], float(replication.undecodable_rows))
        f[names.PAIRS].add_metric([], float(len(pairs)))
        if replication is not None:  # a refitter folds rows already stored: none wait there
            tallied = float(replication.backlog)
        f[names.QUEUE_DEPTH].add_metric([], tallied)

    def add_pair(self, f: Families, pair: Any) -> None:
        """One pair's samples."""
        m = self._metrics
        pid = pair.id
        est = pair.estimator
        key = pair.key
        f[names.PAIR_INFO].add_metric(
            [
                pid,
                key.target,
                key.draft,
                key.method,
                str(key.k),
                pair.rule_name,
                ",".join(f"{k}={v}" for k, v in key.labels.items()),
            ],
            1.0,
        )
        coef = est.coefficients
        f[names.SLOPE].add_metric([pid], coef.slope)
        for i, b in enumerate(coef.intercepts):
            f[names.INTERCEPT].add_metric([pid, str(i)], b)
        f[names.COEFFICIENTS_VERSION].add_metric([pid], float(est.version))
        f[names.ROUND].add_metric([pid], float(est.round))
        strata = pair.strata
        for name, own in strata.strata.items() if strata is not None else ():
            f[names.STRATUM_SLOPE].add_metric([pid, name], own.coefficients.slope)
            f[names.STRATUM_DRAFTS].add_metric([pid, name], float(own.drafts))
            if own.calibration is not None:
                cal = own.calibration.summary()
                f[names.STRATUM_ECE].add_metric([pid, name], cal.ece)
                f[names.STRATUM_LOG_LOSS].add_metric([pid, name], cal.logloss)
        fallback = strata.fallback_rows if strata is not None else 0
        f[names.STRATA_FALLBACK_ROWS].add_metric([pid], float(fallback))
        s = m.summary(pair)
        _calibration(f, pid, s, _ALL_TIME)
        f[names.CALIBRATION_DRAFTS].add_metric([pid], s.count)
        _calibration(f, pid, m.recent_summary(pair), _RECENT)
        f[names.LAST_OBSERVED].add_metric([pid], float(pair.updated))
        f[names.DRAFTS_OBSERVED].add_metric([pid], float(est.drafts))
        f[names.STEPS_OBSERVED].add_metric([pid], float(est.steps))
        counts = m.refit_counts(pid)
        for outcome in OUTCOMES:
            f[names.REFITS].add_metric([pid, outcome], float(counts.get(outcome, 0)))
        _curves(f, pid, s, m.reliability(pair))
        _calibration_layer(f, pid, est.recalibrator)
        schedules = getattr(m.app, "schedules", None)
        for served in schedules.of(pid) if schedules is not None else ():
            for r in served.ranges():
                start = str(r.start)
                hw = served.hardware
                f[names.SCHEDULE_GOODPUT].add_metric(
                    [pid, hw, start, "scheduled"], r.expected_goodput
                )
                f[names.SCHEDULE_GOODPUT].add_metric(
                    [pid, hw, start, "best_fixed"], r.best_fixed_goodput
                )
                f[names.SCHEDULE_LENGTH].add_metric([pid, hw, start, str(r.end)], float(r.length))


#: The families of a calibration summary: AUC, ECE, log loss, then per position the
#: predicted and the observed acceptance; of every draft, and of the recent ones.
_ALL_TIME = (
    names.AUC,
    names.ECE,
    names.LOG_LOSS,
    names.PREDICTED_ACCEPTANCE,
    names.OBSERVED_ACCEPTANCE,
)
_RECENT = (
    names.RECENT_AUC,
    names.RECENT_ECE,
    names.RECENT_LOG_LOSS,
    names.RECENT_PREDICTED_ACCEPTANCE,
    names.RECENT_OBSERVED_ACCEPTANCE,
)


def _calibration(f: Families, pid: str, s: CalibrationSummary, families: tuple[str, ...]) -> None:
    """One calibration summary into its pair-level and per-position gauges."""
    auc, ece, log_loss, predicted, observed = families
    f[auc].add_metric([pid], s.auc)
    f[ece].add_metric([pid], s.ece)
    f[log_loss].add_metric([pid], s.logloss)
    for i, p in enumerate(s.by_position):
        f[predicted].add_metric([pid, str(i)], p.mean_predicted)
        f[observed].add_metric([pid, str(i)], p.observed)


def _curves(f: Families, pid: str, s: CalibrationSummary, rel: Reliability) -> None:
    """Survival through each position (running products of the cumulative
    per-position rates) and the cumulative reliability bins, all positions pooled."""
    predicted = observed = 1.0
    for i, p in enumerate(s.by_position):
        predicted *= p.mean_predicted
        observed *= p.observed
        f[names.PREDICTED_SURVIVAL].add_metric([pid, str(i)], predicted)
        f[names.OBSERVED_SURVIVAL].add_metric([pid, str(i)], observed)
    for b in range(len(rel.count)):
        f[names.RELIABILITY_DRAFTS].add_metric([pid, str(b)], float(rel.count[b]))
        f[names.RELIABILITY_PREDICTED].add_metric([pid, str(b)], float(rel.mean_predicted[b]))
        f[names.RELIABILITY_OBSERVED].add_metric([pid, str(b)], float(rel.observed[b]))


def _calibration_layer(f: Families, pid: str, layer: Any) -> None:
    """Whether the pair's calibration layer is served, and its recent log-loss gain."""
    if layer is None:
        return
    mapped, plain = layer.recent_logloss
    f[names.CALIBRATION_LAYER_SERVED].add_metric([pid], 1.0 if layer.active else 0.0)
    f[names.CALIBRATION_LAYER_GAIN].add_metric([pid], plain - mapped)


def exported(app: Any) -> list[Any]:
    """The pairs whose series this process exports: every pair it holds, or on
    replicas those it refits (the others' series come from their refitters)."""
    pairs = list(app.registry.pairs.values())
    replication = getattr(app, "replication", None)
    if replication is None:
        return pairs
    return [pair for pair in pairs if replication.leads(pair)]


def queue_depth(applied: dict[str, int], durable: dict[str, int]) -> int:
    """Sequence numbers applied but not yet durable, summed over workers.

    Exact when a worker numbers its steps consecutively (the client does);
    a gap in a worker's sequence counts as that many steps.
    """
    return sum(max(0, seq - durable.get(worker, 0)) for worker, seq in applied.items())
