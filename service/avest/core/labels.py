"""Labels from verification verdicts.

A request that verified ``d`` drafts and accepted ``a`` of them labels the
accepted drafts (1) and the first rejected one (0); drafts after it, and
drafts trimmed before verification, are unlabeled. In vLLM's terms a request
reports ``num_sampled`` (accepted + 1 bonus token, 0 while prefilling) and
``num_rejected`` (verified - accepted).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest_wire.errors import InvalidInput

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


def check_counts(
    num_verified: npt.ArrayLike, num_accepted: npt.ArrayLike, rows: int, k: int
) -> tuple[IntArray, IntArray]:
    """Validate per-request counts: ``0 <= accepted <= verified <= K``."""
    d = np.asarray(num_verified)
    a = np.asarray(num_accepted)
    for name, v in (("num_verified", d), ("num_accepted", a)):
        if v.shape != (rows,):
            raise InvalidInput(name, f"must have shape [{rows}], got {list(v.shape)}")
        if (
            v.size
            and not np.issubdtype(v.dtype, np.integer)
            and (not np.all(np.isfinite(v)) or np.any(v != np.round(v)))
        ):
            raise InvalidInput(name, "must be whole numbers")
    d64 = d.astype(np.int64)
    a64 = a.astype(np.int64)
    if d64.size and (d64.min() < 0 or d64.max() > k):
        raise InvalidInput("num_verified", f"must lie in [0, K={k}]")
    if a64.size and (a64.min() < 0 or np.any(a64 > d64)):
        raise InvalidInput("num_accepted", "must lie in [0, num_verified]")
    return d64, a64


def labels(
    num_verified: IntArray, num_accepted: IntArray, k: int, exclude: BoolArray | None = None
) -> tuple[BoolArray, BoolArray]:
    """``(observed[R, K], accepted[R, K])`` for validated counts.

    Position ``i`` is observed iff ``i <= a`` and ``i < d``; accepted iff
    ``i < a``. Rows flagged in ``exclude`` observe nothing.
    """
    pos = np.arange(k)[None, :]
    a = num_accepted[:, None]
    observed = (pos <= a) & (pos < num_verified[:, None])
    if exclude is not None:
        observed &= ~exclude[:, None]
    return observed, pos < a


def check_exclude(exclude: npt.ArrayLike | None, rows: int) -> BoolArray | None:
    if exclude is None:
        return None
    e = np.asarray(exclude)
    if e.size == 0:
        return None
    if e.shape != (rows,):
        raise InvalidInput("exclude", f"must have shape [{rows}], got {list(e.shape)}")
    return e.astype(bool)


def counts_from_vllm(
    num_sampled: npt.ArrayLike, num_rejected: npt.ArrayLike
) -> tuple[IntArray, IntArray]:
    """vLLM's ``(num_sampled, num_rejected)`` to ``(num_verified, num_accepted)``."""
    s = np.asarray(num_sampled, dtype=np.int64)
    r = np.asarray(num_rejected, dtype=np.int64)
    if s.shape != r.shape or s.ndim != 1:
        raise InvalidInput("num_rejected", "must match num_sampled's 1-D shape")
    if (s < 0).any() or (r < 0).any():
        raise InvalidInput("num_sampled", "counts must be >= 0")
    a = np.maximum(s - 1, 0)
    return a + r, a
