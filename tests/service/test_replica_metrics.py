"""Metrics that add up across replicas (:mod:`avest.metrics.collector`): two real
``avest serve`` replicas on one real PostgreSQL database, both scraped.

- Every series of the pair (its coefficients, calibration, refits, worker table)
  comes from the replica that refits it, and from no other; the series that are
  not per pair come from both, ``avest_replica_info`` naming each, and
  ``avest_pairs`` summed over the two counts the pair once.
- The refitter stopped, the other takes the pair over and its series with it.
- ``avest_queue_depth`` on a replica, each its own: in tests/service/test_replicas.py
  (PostgreSQL stopped).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.helpers import wait_until
from tests.support.postgres import PostgresCluster, import_psycopg

import_psycopg()
from avest.metrics import names  # noqa: E402
from tests.support.replicas import (  # noqa: E402
    WAIT_S,
    pair_on_replicas,
    refitted,
    refitter_and_other,
    send,
    settled,
)
from tests.support.rpc import synthetic_steps  # noqa: E402
from tests.support.serve import Served  # noqa: E402

pytestmark = pytest.mark.slow

K = 3
#: Steps per worker: with REFIT_INTERVAL, several refits, so every refit outcome
#: and calibration series has something behind it.
STEPS = 30
REFIT_INTERVAL = 10
#: Families of the pair's own series, a few from each source: the pair collector
#: (coefficients, calibration, survival, reliability bins, refits, ingestion) and
#: the worker table.
PER_PAIR = (
    names.PAIR_INFO,
    names.SLOPE,
    names.INTERCEPT,
    names.COEFFICIENTS_VERSION,
    names.RECENT_ECE,
    names.OBSERVED_SURVIVAL,
    names.RELIABILITY_DRAFTS,
    names.REFITS,
    names.STEPS_OBSERVED,
    names.WORKERS,
    names.WORKER_STEPS,
)
#: Families every replica exports, whatever it refits.
GLOBAL = (
    names.INFO,
    names.PAIRS,
    names.QUEUE_DEPTH,
    names.OPEN_STREAMS,
    names.STORE_WRITABLE,
    names.REPLICA_PAIRS_REFITTED,
    names.REPLICAS_LIVE,
)

Scraped = dict[str, list[tuple[dict[str, str], float]]]


def scrape(replica: Served) -> Scraped:
    """Every sample of the replica's /metrics, by family (counters by their
    ``_total`` name, as :mod:`avest.metrics.names` spells them)."""
    out: Scraped = {}
    for family in text_string_to_metric_families(replica.metrics_text()):
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out.setdefault(s.name, []).append((s.labels, float(s.value)))
    return out


def of_pair(scraped: Scraped, pair_id: str) -> dict[str, int]:
    """How many series of each family are the pair's."""
    counts: dict[str, int] = {}
    for name, samples in scraped.items():
        n = sum(1 for labels, _ in samples if labels.get("pair") == pair_id)
        if n:
            counts[name] = n
    return counts


def value(scraped: Scraped, name: str, **labels: str) -> float:
    found = [
        v for got, v in scraped.get(name, []) if all(got.get(k) == x for k, x in labels.items())
    ]
    assert len(found) == 1, (name, labels, scraped.get(name))
    return found[0]


def test_each_pairs_series_come_from_its_refitter_alone(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    with pair_on_replicas(postgres_cluster, tmp_path, 2, K, REFIT_INTERVAL) as (
        url,
        group,
        pair_id,
    ):
        lead, other = refitter_and_other(group)
        # tests.support.replicas names replica i "r<i>".
        lead_name, other_name = (f"r{group.index(r)}" for r in (lead, other))
        # A worker on each replica: the other one's steps reach the pair through
        # the pending log, folded by the refitter.
        assert send(lead, synthetic_steps(pair_id, "w0", K, STEPS, seed=0)) == STEPS
        assert send(other, synthetic_steps(pair_id, "w1", K, STEPS, seed=1)) == STEPS
        settled(url, group, pair_id, 2 * STEPS)

        led, held = scrape(lead), scrape(other)
        mine = of_pair(led, pair_id)
        for name in PER_PAIR:
            assert mine.get(name), f"{name}: none of the pair's series on its refitter"
        assert of_pair(held, pair_id) == {}, "the pair's series on a replica that does not refit it"
        assert value(led, names.STEPS_OBSERVED, pair=pair_id) == 2 * STEPS
        assert value(led, names.WORKERS, pair=pair_id) == 2

        for scraped in (led, held):
            for name in GLOBAL:
                assert scraped.get(name), f"{name} missing on a replica"
            assert value(scraped, names.REPLICAS_LIVE) == 2
            assert value(scraped, names.QUEUE_DEPTH) == 0  # every step acknowledged
        assert value(led, names.REPLICA_INFO, replica=lead_name) == 1
        assert value(held, names.REPLICA_INFO, replica=other_name) == 1
        assert {labels["replica"] for labels, _ in led[names.REPLICA_INFO]} == {lead_name}
        # Summed over the replicas, the pair is counted once.
        assert value(led, names.PAIRS) + value(held, names.PAIRS) == 1
        assert value(led, names.REPLICA_PAIRS_REFITTED) == 1
        assert value(held, names.REPLICA_PAIRS_REFITTED) == 0

        # The refitter leaves (SIGTERM: it folds what is pending and hands the
        # pair over): its series move to the replica that takes the pair over.
        # The worker table lives in the refitter's memory (as in one process over
        # a restart): it fills again as the workers send.
        lead.stop()
        assert wait_until(lambda: refitted(other) == 1, WAIT_S, 0.1)
        more = synthetic_steps(pair_id, "w1", K, STEPS + REFIT_INTERVAL, seed=1)[STEPS:]
        assert send(other, more) == STEPS + REFIT_INTERVAL
        settled(url, [other], pair_id, 2 * STEPS + REFIT_INTERVAL)
        moved = scrape(other)
        assert set(of_pair(moved, pair_id)) == set(mine)
        assert value(moved, names.STEPS_OBSERVED, pair=pair_id) == 2 * STEPS + REFIT_INTERVAL
        assert value(moved, names.PAIRS) == 1
