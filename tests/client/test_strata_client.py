"""Strata from the Python client against a real server: a forwarder sends each row's
stratum and a summary's stratum, and receives each stratum's coefficients with the
pushes; bad strata are not queued (counted invalid); without strata nothing changes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from avest_client import EstimatorClient
from avest_client.summary import RoundAccumulator
from avest_wire.strata import MAX_STRATA
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.helpers import wait_until

K = 4
NAMES = ("greedy", "t0.5-1")


def _step(rng: np.random.Generator, rows: int = 6):
    x = rng.normal(1.0, 1.5, size=(rows, K))
    d = np.full(rows, K)
    a = np.minimum(rng.integers(0, K + 1, size=rows), d)
    return x, d, a, [NAMES[r % 2] for r in range(rows)]


@contextlib.contextmanager
def _forwarder(server, label: str) -> Iterator[tuple[Any, Any]]:
    """A pair of its own (labelled ``label``) and a forwarder for it: ``(registration,
    forwarder)``."""
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register("t", "d", "eagle", K, {"strata": label}, refit_interval=10)
        fwd = client.forwarder(reg.pair_id, "w0", k=K)
        try:
            yield reg, fwd
        finally:
            fwd.close()


def test_a_forwarder_sends_strata_and_receives_theirs(server) -> None:
    rng = np.random.default_rng(0)
    with _forwarder(server, "raw") as (reg, fwd):
        for _ in range(30):
            x, d, a, names = _step(rng)
            fwd.submit(x, d, a, None, names)
        assert fwd.flush(20)
        assert fwd.stats.invalid == 0 and fwd.stats.refused == 0
        # Once the last push is the server's current version, the strata agree.
        assert wait_until(
            lambda: fwd.latest_coefficients().version == server_strata(server, reg.pair_id)[1],
            timeout=20,
        )
        got, _ = server_strata(server, reg.pair_id)
        pushed = fwd.latest_strata()
        assert set(got) == set(pushed) == set(NAMES)
        for name, (slope, intercepts) in got.items():
            assert pushed[name].slope == slope and pushed[name].intercepts == intercepts


def server_strata(server, pair_id: str):
    import grpc

    from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.grpc_address) as channel:
        c = (
            pb_grpc.EstimatorServiceStub(channel)
            .GetCoefficients(pb.GetCoefficientsRequest(pair_id=pair_id), timeout=10)
            .coefficients
        )
    return {s.stratum: (s.slope, tuple(s.intercepts)) for s in c.strata}, c.version


def test_a_summary_names_its_stratum(server) -> None:
    rng = np.random.default_rng(1)
    with _forwarder(server, "summary") as (reg, fwd):
        coef = reg.coefficients
        for _ in range(3):
            for name in NAMES:
                acc = RoundAccumulator(K)
                for _ in range(3):
                    x, d, a, _ = _step(rng)
                    acc.add(x, d, a, coef.slope, coef.intercepts)
                summary = acc.take(coef.version, coef.slope, coef.intercepts)
                assert summary is not None
                fwd.submit_summary(summary, name)
        assert fwd.flush(20)
        assert fwd.stats.invalid == 0 and fwd.stats.refused == 0
        strata, _ = server_strata(server, reg.pair_id)
        assert set(strata) == set(NAMES)


def test_bad_strata_are_not_queued(server) -> None:
    rng = np.random.default_rng(2)
    with _forwarder(server, "bad") as (reg, fwd):
        x, d, a, names = _step(rng)
        fwd.submit(x, d, a, None, names[:-1])  # one short
        fwd.submit(x, d, a, None, ["a\nb"] * len(names))
        many = [f"s{i}" for i in range(MAX_STRATA + 1)]
        x2, d2, a2, _ = _step(rng, rows=len(many))
        fwd.submit(x2, d2, a2, None, many)
        acc = RoundAccumulator(K)
        acc.add(x, d, a, 0.5, [-0.2] * K)
        summary = acc.take(0, 0.5, [-0.2] * K)
        assert summary is not None
        fwd.submit_summary(summary, "x" * 65)
        fwd.submit(x, d, a)  # a step without strata goes
        assert fwd.flush(20)
        assert fwd.stats.invalid == 4
        assert "strata" in fwd.last_invalid or "stratum" in fwd.last_invalid
        assert server_strata(server, reg.pair_id)[0] == {}
