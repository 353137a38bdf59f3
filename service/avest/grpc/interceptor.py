"""gRPC server interceptor timing every call by method and final status.

Observes :data:`avest.metrics.names.RPC_DURATION`: unary calls from request to
response, streams from start to end (so a stream's duration is its lifetime),
labelled by :func:`method_label` and the status code name the call ended with.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Histogram

from avest.grpc.handlers import rebuilt

_ESTIMATOR_PREFIX = "/avest.v1.EstimatorService/"


def method_label(full_method: str) -> str:
    """``"/avest.v1.EstimatorService/Observe"`` -> ``"Observe"``; other services
    keep ``"package.Service/Method"``."""
    if full_method.startswith(_ESTIMATOR_PREFIX):
        return full_method[len(_ESTIMATOR_PREFIX) :]
    return full_method.lstrip("/")


def status_name(context: Any, exc: BaseException | None) -> str:
    """The status code name a call ended with."""
    code = None
    try:
        code = context.code()
    except Exception:  # not every context implements code()
        code = None
    if isinstance(code, grpc.StatusCode):
        if exc is None or code != grpc.StatusCode.OK:
            return str(code.name)
    elif isinstance(code, int) and exc is None:
        # Some grpc versions report the raw integer.
        for sc in grpc.StatusCode:
            if sc.value[0] == code:
                return str(sc.name)
    if exc is None:
        return "OK"
    if isinstance(exc, (GeneratorExit, StopAsyncIteration)):
        return "CANCELLED"
    if isinstance(exc, asyncio.CancelledError):
        try:
            remaining = context.time_remaining()
        except Exception:
            remaining = None
        if remaining is not None and remaining <= 0:
            return "DEADLINE_EXCEEDED"
        return "CANCELLED"
    return "UNKNOWN"


#: Timed handlers kept before the cache starts over.
_MAX_TIMED = 512


class RpcInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Times every call (streams: start to end) by method and final status."""

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._children: dict[tuple[str, str], Any] = {}
        #: Timed handlers by the handler they wrap (the gate returns the same
        #: handler object for every call of a method): wrapped once, not per call.
        self._timed: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def _observe(self, method: str, code: str, seconds: float) -> None:
        child = self._children.get((method, code))
        if child is None:
            child = self._children[(method, code)] = self._histogram.labels(method, code)
        child.observe(seconds)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: UNIMPLEMENTED, never labelled
            return handler
        known = self._timed.get(id(handler))
        if known is not None and known[0] is handler:
            return known[1]
        timed = self._wrap(method_label(handler_call_details.method), handler)
        if len(self._timed) >= _MAX_TIMED:  # per-call handlers (refusals) do not pile up
            self._timed.clear()
        self._timed[id(handler)] = (handler, timed)
        return timed

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        unary = functools.partial(self._wrap_unary, method)
        stream = functools.partial(self._wrap_stream, method)
        return rebuilt(
            handler,
            {
                "unary_unary": unary,
                "stream_unary": unary,
                "unary_stream": stream,
                "stream_stream": stream,
            },
            handler.request_deserializer,
        )

    def _wrap_unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def timed(request: Any, context: Any) -> Any:
            t0 = time.perf_counter()
            exc: BaseException | None = None
            try:
                result = behavior(request, context)
                if hasattr(result, "__await__"):
                    result = await result
                return result
            except BaseException as e:
                exc = e
                raise
            finally:
                self._observe(method, status_name(context, exc), time.perf_counter() - t0)

        return timed

    def _wrap_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(behavior):
            # A handler that writes with context.write() and returns nothing.
            return self._wrap_unary(method, behavior)

        async def timed(request: Any, context: Any) -> AsyncIterator[Any]:
            t0 = time.perf_counter()
            exc: BaseException | None = None
            result: Any = None
            try:
                result = behavior(request, context)
                if hasattr(result, "__aiter__"):
                    async for item in result:
                        yield item
                elif hasattr(result, "__await__"):
                    await result
                elif result is not None:
                    for item in result:
                        yield item
            except BaseException as e:
                exc = e
                raise
            finally:
                aclose = getattr(result, "aclose", None)
                if exc is not None and aclose is not None:
                    # Already failing: keep the first error.
                    with contextlib.suppress(BaseException):
                        await aclose()
                self._observe(method, status_name(context, exc), time.perf_counter() - t0)

        return timed
