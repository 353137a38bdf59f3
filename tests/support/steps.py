"""Decode steps with a known logistic truth, and predict-then-learn scoring, for the
estimator's tests (``(features, num_verified, num_accepted)`` per step)."""

from __future__ import annotations

import numpy as np

from avest.core.estimator import make_batch
from avest.core.labels import labels
from avest.core.metrics import CalibrationState
from avest.core.model import Coefficients, linear_predictor

#: The draft length of :func:`synthetic_steps` unless given.
K = 5


def synthetic_steps(n: int, rows: int = 16, k: int = K, seed: int = 0):
    """Decode steps drawn from a logistic truth: slope 0.55, falling intercepts."""
    rng = np.random.default_rng(seed)
    truth = Coefficients.of(0.55, np.linspace(0.8, -0.6, k))
    out = []
    for _ in range(n):
        x = rng.normal(2.0, 2.5, size=(rows, k))
        p = 1.0 / (1.0 + np.exp(-linear_predictor(truth, x)))
        acc = rng.random((rows, k)) < p
        a = np.argmin(np.concatenate([acc, np.zeros((rows, 1), bool)], axis=1), axis=1)
        d = np.minimum(a + rng.integers(0, 2, rows), k)
        out.append((x, d, a))
    return out


def batches(steps, k=K):
    return [make_batch(x, d, a, k) for x, d, a in steps]


def draw_step(rng, rows, k, slope, intercepts, loc=1.0, scale=2.5):
    x = rng.normal(loc, scale, size=(rows, k)).clip(-40, 40)
    p = 1 / (1 + np.exp(-(slope * x + np.asarray(intercepts))))
    success = rng.random((rows, k)) < p
    accepted = np.where(success.all(axis=1), k, np.argmin(success, axis=1))
    return x, np.full(rows, k), accepted


def replay(estimator, steps, first_scored):
    """Predict-then-learn; the calibration of the steps from ``first_scored`` on."""
    k = estimator.k
    whole, half = CalibrationState.empty(k), CalibrationState.empty(k)
    for i, (x, d, a) in enumerate(steps):
        obs, acc = labels(d.astype(np.int64), a.astype(np.int64), k)
        eta = linear_predictor(estimator.coefficients, x)
        whole.update(eta, obs, acc)
        if i >= first_scored:
            half.update(eta, obs, acc)
        estimator.observe(x, d, a)
    return whole.summary(), half.summary()


def trimmed_steps(n: int, rows: int, k: int, seed: int) -> list[tuple[np.ndarray, ...]]:
    """Steps as adaptive verification leaves them: a request's drafts are verified up to
    its first one with ``x < 0`` (none at all for some), accepted up to a first rejection."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(1.0, 2.0, size=(rows, k)).astype(np.float32)
        low = x < 0.0
        d = np.where(low.any(axis=1), np.argmax(low, axis=1), k)
        ok = rng.random((rows, k)) < 1.0 / (1.0 + np.exp(-x))
        a = np.minimum(np.where(ok.all(axis=1), k, np.argmin(ok, axis=1)), d)
        out.append((x, d.astype(np.int32), a.astype(np.int32)))
    return out


def reached_by_brute_force(steps: list[tuple[np.ndarray, ...]], k: int) -> np.ndarray:
    """``[K, FEATURE_BINS]``: each request's drafts ``0 .. a`` (every earlier one
    accepted) by feature bin, for requests with something verified, one by one."""
    from avest_wire.bins import FEATURE_BINS, feature_bin

    want = np.zeros((k, FEATURE_BINS))
    for x, d, a in steps:
        for r in range(x.shape[0]):
            if d[r] == 0:
                continue  # nothing verified: a raw step cannot tell trimmed from undrafted
            for i in range(min(int(a[r]), k - 1) + 1):
                want[i, feature_bin(float(x[r, i]))] += 1
    return want
