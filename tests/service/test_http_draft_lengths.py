"""``GET /v1/pairs/{id}/draft-lengths`` on a real service: the recommended
num_speculative_tokens per concurrency from the pair's cost curves and estimates."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from avest.core.costs import CostTable
from avest.core.draft_length import best_lengths, expected_tokens
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.http import feed, register
from tests.support.live import TOKEN, Live

# Drafting a proposal of K=5 costs 5 ms at any batch (1 ms a position for an
# autoregressive drafter); verification is flat up to 64 tokens, then 0.5 ms a token.
DRAFT = [(1, 5.0), (1024, 5.0)]
VERIFY = [(1, 20.0), (64, 20.0), (2048, 1012.0)]


def set_costs(live: Live, pair_id: str, hardware: str = "gpu") -> None:
    live.stub.SetCostCurves(
        pb.SetCostCurvesRequest(
            pair_id=pair_id,
            hardware=hardware,
            draft_curve=[pb.CostPoint(size=s, ms=m) for s, m in DRAFT],
            verify_curve=[pb.CostPoint(size=s, ms=m) for s, m in VERIFY],
        ),
        timeout=10,
        metadata=(("authorization", f"Bearer {TOKEN}"),),
    )


@pytest.fixture
def fed(live: Live, trace_slice: Any) -> tuple[Live, str]:
    trace = trace_slice("sample", 0, 150)
    pid = register(live, k=trace.k, refit_interval=10)
    feed(live, trace, pid)
    return live, pid


def test_recommends_the_best_fixed_length_from_curves_and_estimates(fed: tuple[Live, str]) -> None:
    live, pid = fed
    set_costs(live, pid)
    r = live.http.get(f"/v1/pairs/{pid}/draft-lengths", params={"concurrency": "1,8,64"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["hardware"] == "gpu" and body["drafter"] == "autoregressive"  # method eagle
    rates = np.asarray(body["rates"])
    assert rates.shape == (5,) and np.all((rates > 0.1) & (rates < 1.0))
    table = CostTable.from_curves(DRAFT, VERIFY)
    want = best_lengths(rates, table, [1, 8, 64], per_position=True)
    got = body["concurrency"]
    assert [g["num_speculative_tokens"] for g in got] == [w.length for w in want]
    # By hand at C=1: v drafts cost v ms, verification is flat at 20 ms.
    tokens = expected_tokens(rates)
    by_hand = [1000.0 * tokens[v] / (v + 20.0) for v in range(6)]
    np.testing.assert_allclose(got[0]["throughput"], by_hand, rtol=1e-9)
    assert got[0]["num_speculative_tokens"] == int(np.argmax(by_hand)) > 0
    # At C=64 every verified draft costs 0.5 ms: speculation does not pay.
    assert got[2]["num_speculative_tokens"] == 0 and got[2]["gain_over_off"] == 0.0
    # A parallel drafter pays the whole proposal for any length.
    r = live.http.get(
        f"/v1/pairs/{pid}/draft-lengths", params={"concurrency": "1", "drafter": "parallel"}
    )
    par = r.json()["concurrency"][0]["throughput"]
    np.testing.assert_allclose(par[1:], [1000.0 * tokens[v] / 25.0 for v in range(1, 6)])


def test_refusals_name_the_problem(fed: tuple[Live, str]) -> None:
    live, pid = fed
    r = live.http.get(f"/v1/pairs/{pid}/draft-lengths")
    assert r.status_code == 404 and "hardware" in r.json()["detail"]  # no curves yet
    set_costs(live, pid, "a")
    set_costs(live, pid, "b")
    r = live.http.get(f"/v1/pairs/{pid}/draft-lengths")
    assert r.status_code == 422 and "a, b" in r.json()["detail"]
    r = live.http.get(f"/v1/pairs/{pid}/draft-lengths", params={"hardware": "c"})
    assert r.status_code == 404 and "'c'" in r.json()["detail"]
    r = live.http.get(
        f"/v1/pairs/{pid}/draft-lengths", params={"hardware": "a", "concurrency": "8,x"}
    )
    assert r.status_code == 422 and "8,x" in r.json()["detail"]
    r = live.http.get(f"/v1/pairs/{pid}/draft-lengths", params={"hardware": "a", "drafter": "tree"})
    assert r.status_code == 422 and "tree" in r.json()["detail"]
    r = live.http.get("/v1/pairs/0123456789abcdef/draft-lengths")
    assert r.status_code == 404 and "0123456789abcdef" in r.json()["detail"]
