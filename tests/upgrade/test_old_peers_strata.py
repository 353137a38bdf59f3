"""This release's client sending strata to the 0.1.0 service: the old service skips the
unknown fields, pools every row as the pair's traffic (the same coefficients as the same
steps without strata) and pushes no strata, so the client keeps the pair's."""

from __future__ import annotations

import numpy as np
import pytest

from avest_client import EstimatorClient
from tests.support.helpers import wait_until

from .oldrelease import OldServer

pytestmark = pytest.mark.slow

K = 4
STEPS = 30


def _send(client: EstimatorClient, label: str, strata: bool):
    rng = np.random.default_rng(3)
    reg = client.register("t", "d", "draft_model", K, {"strata": label}, "vllm", 10)
    assert not reg.accepts_round_summaries  # the 0.1.0 service indeed
    fwd = client.forwarder(reg.pair_id, worker_id=f"w-{label}", k=K)
    try:
        for _ in range(STEPS):
            x = rng.normal(0.0, 2.0, size=(6, K)).astype(np.float32)
            d = rng.integers(0, K + 1, size=6)
            a = np.minimum(rng.integers(0, K + 1, size=6), d)
            names = ["greedy", "t0.5-1"] * 3 if strata else None
            fwd.submit(x, d, a, None, names)
        assert fwd.flush(30), fwd.stats
        assert fwd.stats.refused == 0 and fwd.stats.invalid == 0
        pair = client.pair(reg.pair_id)
        assert wait_until(
            lambda: (
                (fwd.latest_coefficients() or pair.coefficients).version
                == pair.coefficients.version
            ),
            timeout=20,
        )
        return pair, fwd.latest_strata()
    finally:
        fwd.close()


def test_strata_to_the_0_1_0_service_degrade_to_the_pairs_coefficients(tmp_path):
    with OldServer(tmp_path / "old-data") as old, EstimatorClient(old.grpc_address) as client:
        plain, _ = _send(client, "plain", strata=False)
        mixed, pushed = _send(client, "mixed", strata=True)
    assert mixed.steps_observed == plain.steps_observed == STEPS
    assert mixed.drafts_observed == plain.drafts_observed
    assert mixed.coefficients.version == plain.coefficients.version > 0
    assert mixed.coefficients.slope == plain.coefficients.slope
    assert mixed.coefficients.intercepts == plain.coefficients.intercepts
    assert pushed == {}
