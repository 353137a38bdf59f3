"""Run a callback when a module is imported (now, if it already is), and record what
a vLLM method was called with once it returns.

The plugin is loaded in every vLLM process, including the API server, which
never builds a speculator; importing ``speculator`` there would pull in model
and attention code for nothing. So the patch waits for the worker's own import.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]


def _run(callbacks: list[Callback], module: ModuleType) -> None:
    for cb in callbacks:
        try:
            cb(module)
        except Exception:  # noqa: BLE001 - a failed patch must not break vLLM's import
            logger.exception("avest: post-import hook for %s failed", module.__name__)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callbacks: list[Callback]) -> None:
        self._inner = inner
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _run(self._callbacks, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for inspect/linecache
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}
        self._lock = threading.Lock()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        with self._lock:
            callbacks = self.pending.pop(fullname, None)
        if callbacks is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            # namespace package or legacy loader: leave the import alone
            logger.warning("avest: cannot hook %s (loader %r)", fullname, spec.loader)
            return spec
        spec.loader = _Loader(spec.loader, callbacks)
        return spec


_FINDER = _Finder()


def when_imported(name: str, callback: Callback) -> None:
    module = sys.modules.get(name)
    if module is not None:
        _run([callback], module)
        return
    with _FINDER._lock:
        _FINDER.pending.setdefault(name, []).append(callback)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def record_after(
    cls: type, name: str, record: Callable[..., None], *, missing: str, failed: str
) -> bool | None:
    """Wrap ``cls.<name>`` so that ``record(self, *args, **kwargs)`` runs after each call.

    vLLM's call returns what it returned; a failing ``record`` is logged (``failed``) and
    never reaches vLLM. Idempotent: returns True when it wraps the method now, None when
    it already was wrapped, False (with the warning ``missing``) when the class has none.
    """
    original = getattr(cls, name, None)
    if original is None:
        logger.warning("avest: %s has no %s; %s", cls, name, missing)
        return False
    if getattr(original, "__avest_wrapped__", False):
        return None

    @functools.wraps(original)
    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            record(self, *args, **kwargs)
        except Exception:  # noqa: BLE001 - never fail vLLM's own call
            logger.exception("avest: %s failed", failed)
        return result

    recorded.__avest_wrapped__ = True  # type: ignore[attr-defined]
    setattr(cls, name, recorded)
    return True
