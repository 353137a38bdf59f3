"""Strata on replicas (one PostgreSQL database, real ``avest serve`` processes): a
stream of two strata sent half to each replica gives every replica the strata the
core's StratifiedEstimator computes from the same steps (the steps' strata travel
through the pending log, the strata through the stored pair)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.postgres import PostgresCluster, import_psycopg
from tests.support.strata import INTERVAL, K, core_strata, mixed_steps, strata_messages

import_psycopg()
from tests.support.replicas import register, replicas, send, settled  # noqa: E402

pytestmark = pytest.mark.slow


def test_two_replicas_give_the_cores_strata(
    tmp_path: Path, postgres_cluster: PostgresCluster
) -> None:
    url = postgres_cluster.create_database()
    with replicas(url, 2, tmp_path) as group:
        pair_id = register(group[0], K, INTERVAL)
        msgs = strata_messages(pair_id, mixed_steps(11, 40))
        assert send(group[0], msgs[:20]) == 20
        assert register(group[1], K, INTERVAL) == pair_id
        assert send(group[1], msgs[20:]) == 40
        served = settled(url, group, pair_id, 40)
    want = core_strata(msgs)
    for pair in served:
        c = pair.coefficients
        assert c.slope == want.pooled.coefficients.slope
        assert [s.stratum for s in c.strata] == ["greedy", "t0.5-1"]
        for s in c.strata:
            own = want.coefficients_for(s.stratum)
            assert s.slope == own.slope and tuple(s.intercepts) == own.intercepts, s.stratum
