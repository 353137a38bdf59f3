"""The feature ``x = logit(q_max)`` and its validation.

``q_max`` is the drafter's largest probability, after temperature scaling.
It is a property of the draft *distribution*, not of the token drawn from
it, so trimming on it never conditions on the token being trimmed and
rejection sampling stays lossless. The sampled token's probability scores
better but must never be used to trim.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_LOG_ODDS

FloatArray = npt.NDArray[np.float64]


def logit_qmax_from_logits(
    logits: npt.ArrayLike, temperature: npt.ArrayLike | float = 1.0
) -> FloatArray:
    """``logit(q_max)`` from draft logits ``[..., V]``.

    ``temperature`` broadcasts against the leading dimensions (one per
    request); 0 means greedy and leaves the logits unscaled, as vLLM does.
    Computed as ``-log(sum_{v != argmax} exp(z_v - m))``, ``m = max z``, so that logits
    ``[20, 0]`` give exactly 20, where ``log(q / (1 - q))`` on a float32 ``q``
    would overflow to inf.
    """
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim < 1 or z.shape[-1] < 1:
        raise InvalidInput("logits", f"need a vocabulary axis, got shape {z.shape}")
    if np.isnan(z).any():
        raise InvalidInput("logits", "contains NaN")
    t = np.asarray(temperature, dtype=np.float64)
    if np.isnan(t).any() or (t < 0).any():
        raise InvalidInput("temperature", "must be >= 0 and not NaN")
    t = np.where(t > 0, t, 1.0)
    z = z / t[..., None] if t.ndim else z / float(t)
    m = np.max(z, axis=-1, keepdims=True)
    if not np.all(np.isfinite(m)):
        raise InvalidInput("logits", "each row needs a finite maximum")
    shifted = z - m
    # Remove exactly one argmax term (the e^0 = 1 it contributes).
    idx = np.argmax(z, axis=-1)[..., None]
    np.put_along_axis(shifted, idx, -np.inf, axis=-1)
    with np.errstate(divide="ignore"):
        log_rest = np.log(np.sum(np.exp(shifted), axis=-1))
    x = -log_rest
    return np.asarray(np.clip(x, -MAX_LOG_ODDS, MAX_LOG_ODDS), dtype=np.float64)


def logit_qmax_from_probs(probs: npt.ArrayLike) -> FloatArray:
    """``logit(q_max)`` from a probability vector ``[..., V]``.

    Uses ``log(q_max) - log(sum of the other probabilities)`` so a row with
    all its mass on one token gives +40, not a rounding artefact.
    """
    q = np.asarray(probs, dtype=np.float64)
    if q.ndim < 1 or q.shape[-1] < 1:
        raise InvalidInput("probs", f"need a vocabulary axis, got shape {q.shape}")
    if not np.all(np.isfinite(q)) or (q < 0).any():
        raise InvalidInput("probs", "must be finite and non-negative")
    idx = np.argmax(q, axis=-1)[..., None]
    qmax = np.take_along_axis(q, idx, axis=-1)[..., 0]
    rest = q.copy()
    np.put_along_axis(rest, idx, 0.0, axis=-1)
    other = np.sum(rest, axis=-1)
    with np.errstate(divide="ignore"):
        x = np.log(qmax) - np.log(other)
    return np.asarray(
        np.clip(np.nan_to_num(x, nan=-MAX_LOG_ODDS), -MAX_LOG_ODDS, MAX_LOG_ODDS), dtype=np.float64
    )


def check_features(features: npt.ArrayLike, k: int | None = None) -> FloatArray:
    """Validate a feature matrix ``[R, K]``: finite, within ±40, K as expected."""
    x = np.asarray(features)
    if x.ndim != 2:
        raise InvalidInput("features", f"must be 2-D [R, K], got shape {x.shape}")
    if k is not None and x.shape[1] != k:
        raise InvalidInput("features", f"has K={x.shape[1]}, the pair has K={k}")
    if not np.issubdtype(x.dtype, np.floating):
        x = x.astype(np.float64)
    if x.size and not bool((np.abs(x) <= MAX_LOG_ODDS).all()):  # one pass; NaN fails too
        if not np.all(np.isfinite(x)):
            raise InvalidInput("features", "contains NaN or infinite values")
        raise InvalidInput("features", f"values must lie in [-{MAX_LOG_ODDS}, {MAX_LOG_ODDS}]")
    return np.asarray(x, dtype=np.float64)
