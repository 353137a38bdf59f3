"""The shim's life in a vLLM worker: its estimators' last round at shutdown, and a
worker that builds none.

vLLM never closes its acceptance estimator. In-process the shim's finalizer
runs at interpreter exit, but a worker in its own process (vLLM's default:
the engine core, and with it the worker, is a subprocess) leaves through
``multiprocessing``'s exit path, which runs no ``atexit`` handler, and by then
the estimator may be gone: the last partial round was lost. So every shim
estimator is tracked here (weakly) and closed, its open round sent first,
within a bounded time:

* when vLLM's worker shuts down (``Worker.shutdown``, which vLLM calls in
  every process that holds a worker, before the executor's grace period of
  ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, 5 s, runs out);
* at the process's exit, as a fallback (``multiprocessing.util.Finalize``
  runs in the main process at exit and in ``multiprocessing`` children).

Closing twice is harmless.

An active plugin in a worker that loads a model but builds no estimator
(adaptive verification off, or vLLM's V1 model runner, which has none) sends
nothing. That is logged once, as a warning, and shown in the worker's metrics
(``avest_shim_no_estimator`` = 1).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing.util
import threading
import weakref
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

#: The most seconds closing may take at shutdown (under vLLM's 5 s grace period).
SHUTDOWN_TIMEOUT_S = 3.0

_live: weakref.WeakSet[Any] = weakref.WeakSet()
_built = 0
_warned = False
_lock = threading.Lock()
_finalizer: multiprocessing.util.Finalize | None = None


def track(estimator: Any) -> None:
    """Called by each shim estimator once it is set up (``estimator.avest_close`` exists)."""
    global _built, _finalizer
    with _lock:
        _live.add(estimator)
        _built += 1
        if _finalizer is None:
            _finalizer = multiprocessing.util.Finalize(None, close_all, exitpriority=100)


def built() -> int:
    """How many shim estimators this process has built."""
    return _built


def close_all(timeout: float = SHUTDOWN_TIMEOUT_S) -> int:
    """Close every live shim estimator (open rounds sent first); how many were closed."""
    with _lock:
        estimators = list(_live)
        _live.clear()
    for est in estimators:
        try:
            est.avest_close(timeout)
        except Exception:  # noqa: BLE001 - shutting down: never raise into vLLM
            logger.exception("avest: closing an estimator at shutdown failed")
    return len(estimators)


def check_built(where: str) -> bool:
    """After a worker loaded its model: False (and one warning) if no estimator was built."""
    global _warned
    if _built:
        return True
    if not _warned:
        _warned = True
        logger.warning(
            "avest: the plugin is active (AVEST_ADDRESS is set) but %s built no acceptance "
            "estimator: nothing is sent to the sidecar. vLLM builds one only with adaptive "
            "verification on (speculative_config enable_adaptive_verification) and on its V2 "
            "model runner (VLLM_USE_V2_MODEL_RUNNER=1).",
            where,
        )
        from avest_client.vllm.prom import mark_no_estimator

        mark_no_estimator()
    return False


def install_worker_hooks(module: ModuleType) -> None:
    """Wrap ``module.Worker``'s ``load_model`` (then check) and ``shutdown`` (close first)."""
    cls = getattr(module, "Worker", None)
    if cls is None or getattr(cls, "__avest_lifecycle__", False):
        return
    load_model = cls.load_model
    shutdown = cls.shutdown

    @functools.wraps(load_model)
    def load_model_then_check(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = load_model(self, *args, **kwargs)
        check_built(f"{type(self).__name__} ({type(getattr(self, 'model_runner', None)).__name__})")
        return out

    @functools.wraps(shutdown)
    def close_then_shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        close_all()
        return shutdown(self, *args, **kwargs)

    cls.load_model = load_model_then_check
    cls.shutdown = close_then_shutdown
    cls.__avest_lifecycle__ = True
