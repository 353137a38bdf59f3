"""Steps that a logistic in x cannot follow (the calibration layer's case: acceptance 0.95
above x = 0, 0.3 below), streamed to a live server."""

from __future__ import annotations

from typing import Any

import numpy as np

from avest.core.numeric import sigmoid
from tests.support.live import Live, observe_requests
from tests.support.live import observe as stream

K = 2


def bent_steps(
    n: int, rows: int = 64, seed: int = 0
) -> list[tuple[np.ndarray, list[int], list[int]]]:
    """Acceptance that a logistic in x cannot follow: 0.95 above x = 0, 0.3 below."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(0.0, 3.0, size=(rows, K))
        ok = rng.random((rows, K)) < np.where(x > 0.0, 0.95, 0.3)
        accepted = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1))
        out.append((x.astype(np.float32), [K] * rows, accepted.tolist()))
    return out


def logistic_steps(
    rng: np.random.Generator, n: int, rows: int = 64
) -> list[tuple[np.ndarray, list[int], list[int]]]:
    """Acceptance that the logistic follows: ``sigmoid(0.8 x + 0.3)`` at every position
    (the calibration layer never wins by its margin there), drawn from ``rng``."""
    out = []
    for _ in range(n):
        x = rng.normal(0.0, 3.0, size=(rows, K))
        ok = rng.random((rows, K)) < sigmoid(0.8 * x + 0.3)
        accepted = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1))
        out.append((x.astype(np.float32), [K] * rows, accepted.tolist()))
    return out


def observe(live: Live, pair_id: str, steps: list[Any]) -> None:
    """Stream ``steps`` (``(features, num_verified, num_accepted)``) to the pair; all
    of them acknowledged."""
    msgs = observe_requests(steps, pair_id)
    assert stream(live, msgs) == len(msgs)
