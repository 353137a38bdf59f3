"""Matrices on the wire: float32 little-endian, row-major, with a shape.

Shared by the server and the client (both ship in the ``avest``
distribution); numpy only.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest.core.errors import InvalidInput

F32LE = np.dtype("<f4")


def encode(matrix: npt.ArrayLike) -> tuple[bytes, int, int]:
    """``(bytes, rows, k)`` of a 2-D array as little-endian float32."""
    m = np.ascontiguousarray(matrix, dtype=F32LE)
    if m.ndim != 2:
        raise InvalidInput("features", f"must be 2-D [R, K], got shape {m.shape}")
    return m.tobytes(), int(m.shape[0]), int(m.shape[1])


def decode(data: bytes, rows: int, k: int, field: str = "features") -> npt.NDArray[np.float32]:
    """The ``[rows, k]`` float32 matrix in ``data``; refuses a size mismatch."""
    expected = rows * k * 4
    if len(data) != expected:
        raise InvalidInput(
            field, f"has {len(data)} bytes, expected rows*k*4 = {rows}*{k}*4 = {expected}"
        )
    return np.frombuffer(data, dtype=F32LE).reshape(rows, k)
