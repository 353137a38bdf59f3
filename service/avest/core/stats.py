"""Round statistics: the IRLS sums of one round, per draft position.

For each observed draft at position k with feature x, label y and
prediction p (from the coefficients in force), ``omega = p(1 - p)`` and
``r = y - p``:

    a_k += omega x^2    b_k += omega x    c_k += omega
    g0_k += r x         g1_k += r         n_k += 1

``X^T W X`` is then an arrowhead matrix (a slope row and column plus a
diagonal of intercepts) and ``X^T r`` a vector, so a round costs O(K) memory
however many drafts it pools. The sums merge with ``+``: many workers, one
round.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.numeric import sigmoid

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]

FIELDS = ("a", "b", "c", "g0", "g1", "n")


@dataclass
class RoundStats:
    """Per-position sums ``a, b, c, g0, g1, n``, each float64 ``[K]``."""

    a: FloatArray
    b: FloatArray
    c: FloatArray
    g0: FloatArray
    g1: FloatArray
    n: FloatArray

    @classmethod
    def zeros(cls, k: int) -> RoundStats:
        return cls(*(np.zeros(k, dtype=np.float64) for _ in FIELDS))

    @property
    def k(self) -> int:
        return int(self.a.shape[0])

    def __add__(self, other: RoundStats) -> RoundStats:
        if other.k != self.k:
            raise ValueError(f"cannot merge round statistics with K={self.k} and K={other.k}")
        return RoundStats(*(getattr(self, f) + getattr(other, f) for f in FIELDS))

    def add_(self, other: RoundStats) -> None:
        """In-place ``+=``."""
        for f in FIELDS:
            getattr(self, f)[...] += getattr(other, f)

    def scale(self, factor: float) -> RoundStats:
        """Every sum times ``factor`` (exponential forgetting)."""
        return RoundStats(*(getattr(self, f) * factor for f in FIELDS))

    def labelled(self) -> int:
        return int(round(float(self.n.sum())))

    def to_arrays(self) -> dict[str, FloatArray]:
        return {f: getattr(self, f).copy() for f in FIELDS}

    @classmethod
    def from_arrays(cls, arrays: dict[str, FloatArray]) -> RoundStats:
        return cls(*(np.asarray(arrays[f], dtype=np.float64).copy() for f in FIELDS))

    def equals(self, other: RoundStats, rtol: float = 0.0, atol: float = 0.0) -> bool:
        return other.k == self.k and all(
            np.allclose(getattr(self, f), getattr(other, f), rtol=rtol, atol=atol) for f in FIELDS
        )


def fold(
    features: FloatArray,
    eta: FloatArray,
    observed: BoolArray,
    accepted: BoolArray,
) -> RoundStats:
    """Round statistics of one batch from its linear predictor ``eta = w x + b``.

    All arrays are ``[R, K]``; unobserved drafts contribute nothing. ``eta``
    is the linear predictor at the coefficients the round linearises around.
    """
    mask = observed.astype(np.float64)
    p = sigmoid(eta)
    # p(1 - p) = sigmoid(eta) * sigmoid(-eta), exact in the tails.
    omega = p * sigmoid(-eta) * mask
    r = (accepted.astype(np.float64) - p) * mask
    x = np.where(observed, features, 0.0)
    wx = omega * x
    return RoundStats(
        a=np.einsum("rk,rk->k", wx, x),
        b=wx.sum(axis=0),
        c=omega.sum(axis=0),
        g0=np.einsum("rk,rk->k", r, x),
        g1=r.sum(axis=0),
        n=mask.sum(axis=0),
    )
