"""The acceptance model's coefficients: the one type client, shim and service share.

``p_k = sigmoid(slope * x + intercepts[k])``: one slope shared by every draft position
(a property of the draft/target pair and sampling method) and one intercept per
position (the base acceptance rate at that depth, which moves with the workload).

The math (the service's core) uses ``slope`` and ``intercepts``; what a service serves
adds where it came from: its ``version`` (pushes are compared by it), the refit
``round``, the ``pair_id`` and when it came into force. ``check`` is the one rule for a
usable set: K in ``[1, MAX_K]``, a finite slope ``>= 0`` (acceptance never falls as the
drafter grows more confident), finite intercepts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_K

#: Cold-start coefficients, as vLLM 0.33 (medians across five production pairs).
INIT_SLOPE = 0.5
INIT_INTERCEPT = -0.2


def check_k(k: int, field: str = "k") -> None:
    if not 1 <= k <= MAX_K:
        raise InvalidInput(field, f"K must be in [1, {MAX_K}], got {k}")


def slope_ok(slope: float) -> bool:
    """Finite and ``>= 0``: acceptance never falls as the drafter grows more confident."""
    return math.isfinite(slope) and slope >= 0.0


def check(slope: float, intercepts: Iterable[float]) -> tuple[float, tuple[float, ...]]:
    """``(slope, intercepts)`` as plain floats, or :class:`InvalidInput` naming the field."""
    w = float(slope)
    b = tuple(float(v) for v in intercepts)
    check_k(len(b), "intercepts")
    if not slope_ok(w):
        raise InvalidInput("slope", f"must be finite and >= 0, got {w!r}")
    if not all(math.isfinite(v) for v in b):
        raise InvalidInput("intercepts", "must be finite")
    return w, b


@dataclass(frozen=True)
class Coefficients:
    """A pair's ``slope`` and ``intercepts[K]``, and (when served) their version.

    Compared by value and picklable: the shim compares what its sink holds at every
    step boundary and broadcasts it to its tensor-parallel ranks.
    """

    slope: float
    intercepts: tuple[float, ...]
    version: int = 0
    round: int = 0
    pair_id: str = ""
    #: When this version came into force (server clock, seconds since the epoch).
    update_time: float = 0.0

    @property
    def k(self) -> int:
        return len(self.intercepts)

    @classmethod
    def cold_start(cls, k: int) -> Coefficients:
        check_k(k)
        return cls(INIT_SLOPE, (INIT_INTERCEPT,) * k)

    @classmethod
    def of(cls, slope: float, intercepts: npt.ArrayLike, version: int = 0) -> Coefficients:
        """Checked (:func:`check`): refused with :class:`InvalidInput` if unusable."""
        w, b = check(slope, np.asarray(intercepts, dtype=np.float64).reshape(-1).tolist())
        return cls(w, b, version=int(version))

    def intercept_array(self) -> npt.NDArray[np.float64]:
        return np.asarray(self.intercepts, dtype=np.float64)

    def as_vector(self) -> npt.NDArray[np.float64]:
        """``[slope, intercept_0, ..., intercept_{K-1}]``."""
        return np.concatenate(([self.slope], self.intercept_array()))

    @classmethod
    def from_vector(cls, theta: npt.ArrayLike) -> Coefficients:
        v = np.asarray(theta, dtype=np.float64)
        return cls(float(v[0]), tuple(float(x) for x in v[1:]))
