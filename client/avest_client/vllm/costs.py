"""The cost curves vLLM profiles at start-up, kept for the sink to register with the pair.

vLLM 0.33 measures them during start-up profiling and hands them to
``AdaptiveVerificationManager.set_cost_curves(draft_curve, verify_curve)``
(``[(size, ms)]`` lists; rank 0's are broadcast over the TP group inside that
method). The plugin wraps it to record the curves here; the network sink reads
:func:`latest` (or subscribes) and sends them with the pair's registration.
"""

from __future__ import annotations

import logging
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
