"""The CPU stand-in computes what docs/design.md §1 (vLLM 0.33) says, and looks like vLLM's class."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from avest_client.vllm import contract
from avest_client.vllm.contract_check import FolderSource, check_entry, check_live_class
from tests.support.standin import StandinAcceptanceEstimator, logit_qmax
from tests.support.tracedrive import drive, steps, synthetic_trace


def test_standin_matches_the_estimator_contract():
    assert check_live_class(StandinAcceptanceEstimator) == []
    est = StandinAcceptanceEstimator(8, 4, torch.device("cpu"))
    for name in contract.ESTIMATOR.init_attributes:
        assert hasattr(est, name), name
    assert est.features.shape == (8, 4) and est.features.dtype == torch.float32
    assert est.slope.shape == (1,) and est.intercepts.shape == (4,)
    assert est.info.shape == (4, 3) and est.grad.shape == (4, 2) and est.counts.shape == (4,)
    # the refit-counter statements the shim depends on are written like vLLM's
    from pathlib import Path

    here = Path(inspect.getfile(StandinAcceptanceEstimator)).parent
    for entry in (contract.ESTIMATOR, contract.ENTRIES[1]):
        moved = type(entry)(**{**entry.__dict__, "path": "standin.py"})
        if isinstance(moved, contract.Class):
            moved = contract.Class(
                path="standin.py",
                name="StandinAcceptanceEstimator",
                methods=entry.methods,
                init_attributes=entry.init_attributes,
                class_attributes=entry.class_attributes,
            )
        else:
            moved = contract.Statements(
                path="standin.py",
                cls="StandinAcceptanceEstimator",
                method="step",
                snippets=entry.snippets,
            )
        assert check_entry(FolderSource(here), moved) == []


def _feature_f64(z: np.ndarray) -> np.ndarray:
    m = z.max(-1, keepdims=True)
    e = np.exp(z - m)
    np.put_along_axis(e, z.argmax(-1)[:, None], 0.0, -1)
    with np.errstate(divide="ignore"):
        return np.clip(-np.log(e.sum(-1)), -40, 40)


def test_feature_is_logit_qmax_and_stable():
    rng = np.random.default_rng(0)
    z = rng.normal(0, 3, size=(64, 50))
    got = logit_qmax(torch.tensor(z, dtype=torch.float32)).double().numpy()
    np.testing.assert_allclose(
        got, _feature_f64(z.astype(np.float32).astype(np.float64)), atol=2e-5
    )
    q = np.exp(z - z.max(-1, keepdims=True))
    q /= q.sum(-1, keepdims=True)
    qm = q.max(-1)
    np.testing.assert_allclose(got, np.log(qm / (1 - qm)), atol=5e-4)
    # stable where q -> 1: [20, 0] is exactly 20; one-hot rows clamp to +40
    edge = torch.tensor([[20.0, 0.0], [0.0, -1e9], [3.0, 3.0]])
    assert logit_qmax(edge).tolist() == pytest.approx([20.0, 40.0, 0.0])


def test_predict_writes_features_predictions_and_confidences():
    k, v = 3, 17
    est = StandinAcceptanceEstimator(6, k, torch.device("cpu"))
    est.slope.fill_(0.7)
    est.intercepts.copy_(torch.tensor([0.1, -0.3, -0.6]))
    temperature = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 1.0])
    logits = torch.randn(3, v, generator=torch.Generator().manual_seed(1))
    idx = torch.tensor([2, 1, -1])  # last row is CUDA-graph padding
    conf = torch.full((4, k), -1.0)
    est.predict(logits, idx, torch.tensor(1), conf, temperature)
    x = logit_qmax(torch.stack([logits[0] / 0.5, logits[1]]))  # temperature 0 -> unscaled
    assert torch.allclose(est.features[[2, 1], 1], x)
    p = torch.sigmoid(0.7 * x - 0.3)
    assert torch.allclose(est.predictions[[2, 1], 1], p)
    assert torch.allclose(conf[[0, 1], 1], p)
    assert (conf[2] == -1).all() and (est.features[[0, 3, 4, 5]] == 0).all()
    # per-token steps: each request owns K consecutive rows
    conf2 = torch.zeros(2, k)
    logits2 = torch.randn(2 * k, v, generator=torch.Generator().manual_seed(2))
    est.predict(
        logits2, torch.tensor([4] * k + [5] * k), torch.arange(k).repeat(2), conf2, temperature
    )
    assert torch.allclose(est.features[4], logit_qmax(logits2[:k]))
    assert torch.allclose(conf2[1], est.predictions[5])


def _reference_round(rows, slope, intercepts, l2=1e-3, damping=50.0):
    """docs/design.md §1 round statistics and refit in float64, from (x, p, a, d) rows."""
    k = len(intercepts)
    a_k, b_k, c_k, g0_k, g1_k, n_k = (np.zeros(k) for _ in range(6))
    for x, p, acc, ver in rows:
        for i in range(k):
            if i <= acc and i < ver:
                w, r = p[i] * (1 - p[i]), (1.0 if i < acc else 0.0) - p[i]
                a_k[i] += w * x[i] ** 2
                b_k[i] += w * x[i]
                c_k[i] += w
                g0_k[i] += r * x[i]
                g1_k[i] += r
                n_k[i] += 1
    c = c_k + l2
    step_w = (g0_k.sum() - (b_k * g1_k / c).sum()) / (a_k.sum() + l2 - (b_k**2 / c).sum())
    step_w *= n_k.sum() / (n_k.sum() + damping)
    if np.isnan(step_w) or slope + step_w < 0:
        step_w = 0.0
    step_b = (g1_k - b_k * step_w) / c * (n_k / (n_k + damping))
    return slope + step_w, np.asarray(intercepts) + np.nan_to_num(step_b)


def test_step_accumulates_and_refits_like_design():
    k = 4
    trace = synthetic_trace(steps=30, batch=12, k=k, seed=3)
    est = StandinAcceptanceEstimator(32, k, torch.device("cpu"))
    est.REFIT_INTERVAL = 30
    rows = []
    for s in steps(trace, 32):
        drive(est, s)
        rows += [
            (s.features[i].double().numpy(), est.predictions[s.idx_mapping[i]].double().numpy(),
             int(s.num_accepted[i]), int(s.num_verified[i]))
            for i in range(len(s.idx_mapping))
        ]  # fmt: skip
        if est._refits == 0:
            assert est.counts.sum() > 0
    assert est._refits == 1 and est._steps_since_refit == 0
    assert est.info.abs().sum() == 0 and est.counts.sum() == 0
    w, b = _reference_round(rows, 0.5, [-0.2] * k)
    assert est.slope.item() == pytest.approx(w, abs=2e-4)
    np.testing.assert_allclose(est.intercepts.numpy(), b, atol=2e-4)


def test_negative_slope_step_is_refused():
    n = 200
    est = StandinAcceptanceEstimator(n, 2, torch.device("cpu"))
    est.REFIT_INTERVAL = 1
    est.slope.fill_(0.01)
    # confident drafts rejected, unsure ones accepted: the fit wants a negative slope
    idx = torch.arange(n)
    x = torch.where(idx % 2 == 0, 6.0, -6.0)[:, None].expand(n, 2)
    est.load_features(idx, x)
    accepted = (idx % 2 == 1).to(torch.int32)  # position 0 accepted iff x < 0
    est.step(idx, accepted + 1, 1 - accepted)
    assert est.slope.item() == pytest.approx(0.01)  # the slope step was zeroed
    assert est.intercepts[0].item() != pytest.approx(-0.2)  # intercepts still moved
