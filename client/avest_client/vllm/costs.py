"""The cost curves vLLM profiles at start-up, kept for the sink to register with the pair.

vLLM 0.33 measures them during start-up profiling and hands them to
``AdaptiveVerificationManager.set_cost_curves(draft_curve, verify_curve)``
(``[(size, ms)]`` lists; rank 0's are broadcast over the TP group inside that
method). The plugin wraps it to record the curves here; the network sink reads
:func:`latest` (or subscribes) and sends them with the pair's registration.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from avest_client.vllm.hooks import record_after

logger = logging.getLogger(__name__)

Curve = list[tuple[int, float]]


class CostCurveRecorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: tuple[Curve, Curve] | None = None
        self._cudagraph_limit = 0
        self.version = 0
        self._subscribers: list[Callable[[Curve, Curve], None]] = []

    def record(self, draft_curve: Any, verify_curve: Any, cudagraph_limit: int = 0) -> None:
        draft = [(int(s), float(ms)) for s, ms in draft_curve]
        verify = [(int(s), float(ms)) for s, ms in verify_curve]
        with self._lock:
            self._latest = (draft, verify)
            self._cudagraph_limit = max(0, int(cudagraph_limit or 0))
            self.version += 1
            subscribers = list(self._subscribers)
        for fn in subscribers:
            try:
                fn(draft, verify)
            except Exception:  # noqa: BLE001
                logger.exception("avest: cost-curve subscriber failed")

    def latest(self) -> tuple[Curve, Curve] | None:
        with self._lock:
            return self._latest

    def snapshot(self) -> tuple[int, Curve, Curve, int] | None:
        """``(version, draft, verify, cudagraph_limit)`` of the latest curves, or None."""
        with self._lock:
            if self._latest is None:
                return None
            return self.version, self._latest[0], self._latest[1], self._cudagraph_limit

    def subscribe(self, fn: Callable[[Curve, Curve], None]) -> None:
        """Call ``fn(draft, verify)`` now if curves are known, and on every later record."""
        with self._lock:
            self._subscribers.append(fn)
            latest = self._latest
        if latest is not None:
            fn(*latest)


RECORDER = CostCurveRecorder()


def thin(curve: Curve, max_points: int, cudagraph_limit: int = 0) -> Curve:
    """At most ``max_points`` of a profiled ``[(size, ms)]`` curve (the service takes at
    most ``MAX_COST_POINTS``): the first and the last point, the first at or past the
    CUDA-graph capture limit (where padding ends), and sizes spread evenly in log-size.
    Where a size costs the first profiled size at or above it (up to the limit), a
    dropped point's sizes cost the next one kept: more, never less."""
    points = sorted(curve)
    if len(points) <= max_points:
        return points
    sizes = [s for s, _ in points]
    last = len(points) - 1
    keep = {0, last}
    if cudagraph_limit > 0:
        at = next((i for i, s in enumerate(sizes) if s >= cudagraph_limit), last)
        keep.add(at)
    lo, hi = math.log(max(sizes[0], 1)), math.log(max(sizes[-1], 1))
    spread = max_points - len(keep)
    for j in range(spread):
        target = math.exp(lo + (hi - lo) * (j + 1) / (spread + 1))
        keep.add(min(bisect.bisect_left(sizes, target), last))
    return [points[i] for i in sorted(keep)]


def install_cost_curve_hook(manager_cls: type, recorder: CostCurveRecorder | None = None) -> bool:
    """Wrap ``manager_cls.set_cost_curves`` to record the curves; idempotent."""
    rec = RECORDER if recorder is None else recorder

    def record(manager: Any, draft_curve: Any, verify_curve: Any, *_: Any, **__: Any) -> None:
        limit = getattr(manager, "_cudagraph_limit", 0)
        rec.record(draft_curve, verify_curve, limit if isinstance(limit, int) else 0)

    wrapped = record_after(
        manager_cls,
        "set_cost_curves",
        record,
        missing="cost curves not recorded",
        failed="recording cost curves",
    )
    return wrapped is not False
