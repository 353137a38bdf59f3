"""Per-pair worker tables as metrics, read on each scrape, with bounded cardinality.

Each pair exposes how many workers it remembers, how many it forgot, how many
are quarantined and the steps not folded because of it; the
:data:`~avest.metrics.names.WORKER_SERIES` most recently seen workers get series
of their own (drafts, steps, summaries, coefficient lag, last seen), and
everything else is folded into one ``worker="other"`` series per family, so
a pair adds at most ``5 x (WORKER_SERIES + 1) + 4`` series whatever the
fleet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from avest.metrics.collector import exported
from avest.metrics.names import (
    QUARANTINED_STEPS,
    SPECS,
    WORKER_DRAFTS,
    WORKER_LAG,
    WORKER_LAST_SEEN,
    WORKER_METRICS,
    WORKER_SERIES,
    WORKER_STEPS,
    WORKER_SUMMARIES,
    WORKERS,
    WORKERS_FORGOTTEN,
    WORKERS_QUARANTINED,
    family_name,
)


class WorkerCollector:
    """Reads every pair's :class:`~avest.state.workers.WorkerTable` on a scrape."""

    def __init__(self, app: Any) -> None:
        self._app = app

    def families(self) -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
        out: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            WORKERS: GaugeMetricFamily(WORKERS, SPECS[WORKERS].help, labels=["pair"]),
            WORKERS_FORGOTTEN: CounterMetricFamily(
                family_name(WORKERS_FORGOTTEN), SPECS[WORKERS_FORGOTTEN].help, labels=["pair"]
            ),
            WORKERS_QUARANTINED: GaugeMetricFamily(
                WORKERS_QUARANTINED, SPECS[WORKERS_QUARANTINED].help, labels=["pair"]
            ),
            QUARANTINED_STEPS: CounterMetricFamily(
                family_name(QUARANTINED_STEPS), SPECS[QUARANTINED_STEPS].help, labels=["pair"]
            ),
        }
        for spec in WORKER_METRICS:
            out[spec.name] = GaugeMetricFamily(spec.name, spec.help, labels=list(spec.labels))
        return out

    def describe(self) -> Iterable[Metric]:
        return list(self.families().values())

    def pairs(self) -> list[Any]:
        """Every pair, or on replicas the pairs this replica refits (a pair's worker
        table is exported by its refitter, which judges its workers)."""
        return exported(self._app)

    def add_pair(self, f: Any, pair: Any) -> None:
        pid = pair.id
        table = pair.workers
        f[WORKERS].add_metric([pid], float(len(table)))
        f[WORKERS_FORGOTTEN].add_metric([pid], float(table.forgotten))
        f[WORKERS_QUARANTINED].add_metric([pid], float(table.quarantined))
        f[QUARANTINED_STEPS].add_metric([pid], float(table.quarantined_steps))
        for row in table.top(WORKER_SERIES):
            labels = [pid, row.worker_id]
            f[WORKER_DRAFTS].add_metric(labels, float(row.drafts))
            f[WORKER_STEPS].add_metric(labels, float(row.steps))
            f[WORKER_SUMMARIES].add_metric(labels, float(row.summaries))
            f[WORKER_LAG].add_metric(labels, float(row.lag))
            f[WORKER_LAST_SEEN].add_metric(labels, float(row.last_seen))

    def collect(self) -> Iterable[Metric]:
        f = self.families()
        for pair in self.pairs():
            self.add_pair(f, pair)
        return list(f.values())
