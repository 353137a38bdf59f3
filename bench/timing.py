"""Wall time of repeated calls, for the latency benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable


def call_seconds(
    fn: Callable[[int], object], n: int, warmup: int = 0, first: int = 0
) -> list[float]:
    """Seconds each of ``fn(first)`` .. ``fn(first + n - 1)`` took, after ``warmup`` calls
    that are not timed (``fn(0)`` .. ``fn(warmup - 1)``: connections, caches)."""
    for i in range(warmup):
        fn(i)
    out = []
    for i in range(first, first + n):
        t = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t)
    return out
