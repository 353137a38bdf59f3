"""The shim's life in a vLLM worker: its estimators' last round at shutdown, and a
worker that builds none.

vLLM never closes its acceptance estimator. In-process the shim's finalizer
runs at interpreter exit, but a worker in its own process (vLLM's default:
the engine core is a subprocess, and its worker another) leaves through
``multiprocessing``'s exit path, which runs no ``atexit`` handler, and by then
the estimator may be gone: the last partial round was lost. Nor can the
worker be counted on to shut down in time: vLLM's executor gives it
``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 s) to leave its busy loop, then
sends SIGTERM, while the front end kills the engine core's processes 5 s
after asking it to stop. So every shim estimator is tracked here (weakly)
and closed, its open round sent first, within :data:`SHUTDOWN_TIMEOUT_S`:

* when the engine core begins to shut down (``EngineCore.shutdown``, before
  it stops its executor): a ``collective_rpc`` runs the close in every
  worker while the workers still serve RPCs;
* when vLLM's worker shuts down (``Worker.shutdown``), for an executor that
  does not go through the engine core;
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
    if estimators:
        logger.info("avest: %d estimator(s) closed at shutdown", len(estimators))
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


def close_in_worker(worker: Any = None) -> int:
    """Run by vLLM's ``collective_rpc`` in each worker process (pickled by reference)."""
    return close_all()


def install_engine_hooks(module: ModuleType) -> None:
    """Wrap ``module.EngineCore.shutdown``: the workers close their estimators first."""
    cls = getattr(module, "EngineCore", None)
    if cls is None or getattr(cls, "__avest_lifecycle__", False):
        return
    shutdown = cls.shutdown

    @functools.wraps(shutdown)
    def close_workers_then_shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        executor = getattr(self, "model_executor", None)
        if executor is not None:
            try:
                executor.collective_rpc(close_in_worker, timeout=SHUTDOWN_TIMEOUT_S + 1.0)
            except Exception:  # noqa: BLE001 - shutting down: the worker hook still runs
                logger.warning("avest: closing the workers' estimators failed", exc_info=True)
        return shutdown(self, *args, **kwargs)

    cls.shutdown = close_workers_then_shutdown
    cls.__avest_lifecycle__ = True


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
