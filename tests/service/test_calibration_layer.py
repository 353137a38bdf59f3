"""The calibration layer through the live service: Score, the pushed coefficients,
``GET /v1/pairs/{id}``, the metrics, and a restart from the store."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from avest.core.calibration import SLOTS
from avest.core.numeric import sigmoid
from avest.metrics.names import CALIBRATION_LAYER_GAIN, CALIBRATION_LAYER_SERVED
from avest_wire import matrix as wire
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.calibration import K, bent_steps, logistic_steps, observe
from tests.support.live import Live, register


def metric(live: Live, name: str, pair_id: str) -> float:
    text = live.http.get("/metrics").text
    found = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and s.labels.get("pair") == pair_id
    ]
    assert len(found) == 1, (name, found)
    return float(found[0])


def test_a_bent_workload_gets_the_layer_served_everywhere(
    open_server: Callable[..., Live],
) -> None:
    live = open_server()
    pid = register(live, K, 10, rule=pb.UPDATE_RULE_TRACKING)
    # Before any draft: the layer exists but is not served (identity table).
    coef = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert len(coef.calibration_knots) == len(coef.calibration_logits) == SLOTS
    assert not coef.calibration_served
    assert list(coef.calibration_logits) == list(coef.calibration_knots)
    assert metric(live, CALIBRATION_LAYER_SERVED, pid) == 0.0

    observe(live, pid, bent_steps(300))
    coef = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert coef.calibration_served
    knots = np.array(coef.calibration_knots)
    logits = np.array(coef.calibration_logits)
    assert np.all(np.diff(logits) >= 0.0) and not np.allclose(logits, knots)

    # Score: sigmoid(map(slope * x + b_i)), the table's piecewise-linear map.
    x = np.array([[-3.0, 2.0], [0.5, -0.5], [4.0, 4.0]], dtype=np.float32)
    data, rows, k = wire.encode(x)
    resp = live.stub.Score(pb.ScoreRequest(pair_id=pid, features=data, rows=rows, k=k))
    conf = wire.decode(resp.confidences, rows, k)
    eta = coef.slope * x.astype(np.float64) + np.array(coef.intercepts)
    want = sigmoid(np.interp(eta, knots, logits))
    np.testing.assert_allclose(conf, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(conf, sigmoid(eta), atol=1e-3)

    # GET /v1/pairs/{id}: served, with the map's recent loss below the logistic's.
    layer = live.http.get(f"/v1/pairs/{pid}").json()["calibration_layer"]
    assert layer["served"] is True
    assert layer["recent_logloss"] < layer["recent_logloss_logistic"]
    assert layer["logits"] == pytest.approx(logits.tolist())
    gain = layer["recent_logloss_logistic"] - layer["recent_logloss"]
    assert metric(live, CALIBRATION_LAYER_SERVED, pid) == 1.0
    assert metric(live, CALIBRATION_LAYER_GAIN, pid) == pytest.approx(gain, rel=1e-9)

    # The layer survives a restart through the store, exactly.
    live.stop()
    again = open_server()
    after = again.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert after.calibration_served
    assert list(after.calibration_logits) == list(coef.calibration_logits)
    assert again.http.get(f"/v1/pairs/{pid}").json()["calibration_layer"] == layer


def test_a_logistic_workload_keeps_the_layer_off(open_server: Callable[..., Live]) -> None:
    """Drafts that follow the logistic: the map never wins by the margin, Score stays plain."""
    live = open_server()
    pid = register(live, K, 10, rule=pb.UPDATE_RULE_TRACKING)
    rng = np.random.default_rng(1)
    steps = logistic_steps(rng, 200)
    observe(live, pid, steps)
    coef = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert not coef.calibration_served
    x = rng.normal(0.0, 3.0, size=(4, K)).astype(np.float32)
    data, rows, k = wire.encode(x)
    resp = live.stub.Score(pb.ScoreRequest(pair_id=pid, features=data, rows=rows, k=k))
    eta = coef.slope * x.astype(np.float64) + np.array(coef.intercepts)
    np.testing.assert_allclose(wire.decode(resp.confidences, rows, k), sigmoid(eta), rtol=1e-6)
    assert metric(live, CALIBRATION_LAYER_SERVED, pid) == 0.0
