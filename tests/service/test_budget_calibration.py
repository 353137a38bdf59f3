"""Budget scores features as Score does: through the calibration layer while it is
served, the linear-logistic model otherwise (the live service and the real client)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest

from avest.core.budget import decide
from avest.core.costs import CostTable
from avest.core.numeric import sigmoid
from avest_client import EstimatorClient
from avest_wire import matrix as wire
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.calibration import K, bent_steps, logistic_steps, observe
from tests.support.live import Live, register

R = 48
DRAFT = [(1, 1.0), (16, 1.2), (64, 1.5)]
VERIFY = [(1, 5.0), (32, 5.4), (64, 6.0), (128, 9.0), (256, 14.0)]


def _pair(live: Live, steps: list) -> tuple[str, pb.Coefficients]:
    pid = register(live, K, 10, rule=pb.UPDATE_RULE_TRACKING)
    observe(live, pid, steps)
    with EstimatorClient(live.grpc_address, timeout=10) as client:
        client.set_cost_curves(pid, DRAFT, VERIFY, cudagraph_limit=64)
    coef = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    return pid, coef


def _eta(coef: pb.Coefficients, x: np.ndarray) -> np.ndarray:
    return coef.slope * x.astype(np.float64) + np.array(coef.intercepts)


def _mapped(coef: pb.Coefficients, x: np.ndarray) -> np.ndarray:
    knots, logits = np.array(coef.calibration_knots), np.array(coef.calibration_logits)
    return sigmoid(np.interp(_eta(coef, x), knots, logits))


def _features(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 3.0, size=(R, K)).astype(np.float32)
    stale = rng.normal(0.0, 3.0, size=(R, K)).astype(np.float32)
    return x, stale


def _core(conf: np.ndarray, rule: str = "lossless-walk", stale: np.ndarray | None = None):  # noqa: ANN202
    table = CostTable.from_curves(DRAFT, VERIFY, cudagraph_limit=64)
    return decide(rule, conf, np.full(R, K), table, R, R, stale)


def _budget(live: Live, pid: str, x: np.ndarray, **kw: object):  # noqa: ANN202
    with EstimatorClient(live.grpc_address, timeout=10) as client:
        return client.budget(pid, x, np.full(R, K), R, R, **kw)  # type: ignore[arg-type]


def test_a_served_layer_maps_the_features_a_budget_is_computed_from(
    open_server: Callable[..., Live],
) -> None:
    live = open_server()
    pid, coef = _pair(live, bent_steps(300))
    assert coef.calibration_served
    x, stale = _features(3)
    mapped, plain = _mapped(coef, x), sigmoid(_eta(coef, x))
    assert not np.allclose(mapped, plain, atol=1e-2)  # the map moves the confidences

    got = _budget(live, pid, x, from_features=True)
    want = _core(mapped)
    assert got.calibration_layer_served and got.coefficients_version == coef.version
    assert got.budget == want.budget
    np.testing.assert_array_equal(got.verify_lengths, want.verify_lengths)
    assert got.expected_tokens == pytest.approx(want.expected_tokens, rel=1e-9)
    assert got.cost_ms == pytest.approx(want.cost_ms)
    linear = _core(plain)  # what the budget was before: the linear-logistic confidences
    assert got.expected_tokens != pytest.approx(linear.expected_tokens, rel=1e-6)

    # stale features are scored the same way (the stale rule sizes from them)
    got = _budget(live, pid, x, stale_confidences=stale, from_features=True)
    want = _core(mapped, "stale", _mapped(coef, stale))
    assert got.rule == "stale" and got.budget == want.budget
    np.testing.assert_array_equal(got.verify_lengths, want.verify_lengths)
    assert got.expected_tokens == pytest.approx(want.expected_tokens, rel=1e-9)

    # confidences a client sends are used as sent, never mapped a second time
    served = mapped.astype(np.float32)
    got = _budget(live, pid, served)
    want = _core(served.astype(np.float64))
    assert not got.calibration_layer_served and got.coefficients_version == 0
    np.testing.assert_array_equal(got.verify_lengths, want.verify_lengths)
    assert got.expected_tokens == pytest.approx(want.expected_tokens, rel=1e-6)


def test_without_a_served_layer_features_are_scored_by_the_logistic(
    open_server: Callable[..., Live],
) -> None:
    live = open_server()
    rng = np.random.default_rng(1)
    steps = logistic_steps(rng, 200)
    pid, coef = _pair(live, steps)
    assert not coef.calibration_served
    x, _ = _features(4)
    got = _budget(live, pid, x, from_features=True)
    want = _core(sigmoid(_eta(coef, x)))
    assert not got.calibration_layer_served and got.coefficients_version == coef.version
    assert got.budget == want.budget
    np.testing.assert_array_equal(got.verify_lengths, want.verify_lengths)
    assert got.expected_tokens == pytest.approx(want.expected_tokens, rel=1e-9)


def test_features_and_confidences_do_not_mix(open_server: Callable[..., Live]) -> None:
    live = open_server()
    pid, _ = _pair(live, bent_steps(20))
    x, stale = _features(5)
    data, rows, k = wire.encode(x)
    other, _, _ = wire.encode(stale)
    base = {"pair_id": pid, "rows": rows, "k": k, "scheduled_drafts": [K] * R,
            "num_non_draft_tokens": R, "num_sampling_requests": R}  # fmt: skip
    cases = {
        "confidences": {"features": data, "confidences": other},
        "stale_confidences": {"features": data, "stale_confidences": other},
        "stale_features": {"confidences": other, "stale_features": data},
    }
    for field, extra in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            live.stub.Budget(pb.BudgetRequest(**base, **extra), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.value.details() or "")
    bad = x.copy()
    bad[0, 0] = 41.0  # outside the features' range
    for field, extra in {
        "features": {"features": wire.encode(bad)[0]},
        "stale_features": {"features": data, "stale_features": wire.encode(bad)[0]},
    }.items():
        with pytest.raises(grpc.RpcError) as err:
            live.stub.Budget(pb.BudgetRequest(**base, **extra), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(field)
