"""Matrices on the wire: float32 little-endian, row-major, with a shape.

Shared by the server and the client; numpy only. A malformed matrix raises
:class:`MatrixError`, which names the field so adapters can map it to a clear
wire error.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32LE = np.dtype("<f4")


class MatrixError(ValueError):
    """A matrix that cannot travel: wrong rank, or bytes that do not match its shape."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def encode(matrix: npt.ArrayLike) -> tuple[bytes, int, int]:
    """``(bytes, rows, k)`` of a 2-D array as little-endian float32."""
    m = np.ascontiguousarray(matrix, dtype=F32LE)
    if m.ndim != 2:
        raise MatrixError("features", f"must be 2-D [R, K], got shape {m.shape}")
    return m.tobytes(), int(m.shape[0]), int(m.shape[1])


def decode(data: bytes, rows: int, k: int, field: str = "features") -> npt.NDArray[np.float32]:
    """The ``[rows, k]`` float32 matrix in ``data``; refuses a size mismatch."""
    expected = rows * k * 4
    if len(data) != expected:
        raise MatrixError(
            field, f"has {len(data)} bytes, expected rows*k*4 = {rows}*{k}*4 = {expected}"
        )
    return np.frombuffer(data, dtype=F32LE).reshape(rows, k)
