"""Stable elementwise functions of the linear predictor (numpy only)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]


def sigmoid(eta: npt.ArrayLike) -> FloatArray:
    """``1 / (1 + exp(-eta))`` without overflow for any finite ``eta``."""
    z = np.asarray(eta, dtype=np.float64)
    e = np.exp(-np.abs(z))
    return np.asarray(np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)), dtype=np.float64)


def softplus(eta: npt.ArrayLike) -> FloatArray:
    """``log(1 + exp(eta))``, stable for large ``|eta|``."""
    z = np.asarray(eta, dtype=np.float64)
    return np.asarray(np.maximum(z, 0.0) + np.log1p(np.exp(-np.abs(z))), dtype=np.float64)


def bernoulli_nll(eta: npt.ArrayLike, label: npt.ArrayLike) -> FloatArray:
    """Per-draft log loss from the linear predictor: ``softplus(eta) - y*eta``."""
    z = np.asarray(eta, dtype=np.float64)
    return softplus(z) - np.asarray(label, dtype=np.float64) * z
