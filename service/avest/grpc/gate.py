"""The gRPC gate: tokens, per-client call rate, and malformed messages.

A server interceptor in front of every handler:

- **access**: the call's ``authorization`` metadata against
  :class:`avest.policy.access.Access` (UNAUTHENTICATED / PERMISSION_DENIED,
  before the request is even parsed);
- **rate**: unary calls per client address, a token bucket
  (RESOURCE_EXHAUSTED);
- **malformed messages**: a request that does not parse becomes
  :data:`MALFORMED` instead of an exception deep in gRPC, so a unary call ends
  with INVALID_ARGUMENT and the Observe stream refuses it likewise; each one
  is counted (``avest_refused_batches_total{reason="malformed"}``) and logged
  at most once per interval.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from avest.grpc.handlers import Wrap, rebuilt
from avest.grpc.interceptor import method_label
from avest.grpc.refusals import reason_of
from avest.policy.access import Access, Role, grpc_role
from avest.policy.throttle import KeyedRates, LogLimiter

#: What a request that does not parse is delivered as.
MALFORMED: Any = type("Malformed", (), {"__repr__": lambda self: "<malformed message>"})()

_MAX_CLIENTS = 10_000
#: Gated handlers kept (one per method of the services served).
_MAX_METHODS = 256


def malformed_reply() -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.INVALID_ARGUMENT, "malformed message: not a valid protobuf of this RPC"


def client_host(peer: str) -> str:
    """The client a call's peer (``ipv4:1.2.3.4:5678``) is counted as: its address."""
    return peer.rpartition(":")[0] or peer


def over_client_rate_reply(rate: float) -> tuple[grpc.StatusCode, str]:
    """The refusal of a unary call over its client's rate (``--rpc-rate``), on either port."""
    return (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"more than {rate:g} calls per second from this client; retry later",
    )


class Gate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(
        self,
        access: Access,
        on_refused: Callable[[str, str], None],
        rpc_rate: float = 0.0,
        logs: LogLimiter | None = None,
    ) -> None:
        self.access = access
        self.on_refused = on_refused
        self.rpc_rate = rpc_rate
        self.logs = logs or LogLimiter()
        self._clients = KeyedRates(rpc_rate, _MAX_CLIENTS)
        #: Per method: the gated handler, built once (the access check runs per call).
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}

    # -- pieces ---------------------------------------------------------------

    def _rate_ok(self, peer: str) -> bool:
        return self._clients.take(client_host(peer))

    def malformed(self, method: str) -> None:
        self.on_refused(method, "malformed")
        self.logs.warning("malformed", "malformed %s message(s) refused", method)

    def _parse(self, deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
        if deserializer is None:
            return None

        def parse(data: bytes) -> Any:
            try:
                return deserializer(data)
            except (DecodeError, ValueError, TypeError, RuntimeError):
                return MALFORMED

        return parse

    # -- the interceptor --------------------------------------------------------

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        full = details.method
        cached = self._handlers.get(full)
        handler = cached if cached is not None else await continuation(details)
        if handler is None:
            return handler
        method = method_label(full)
        role = grpc_role(full)
        authorization = None
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                authorization = value if isinstance(value, str) else value.decode(errors="replace")
        denied = self.access.check(role, authorization)
        if denied is not None:
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if denied.unauthenticated
                else grpc.StatusCode.PERMISSION_DENIED
            )
            self.on_refused(method, reason_of(code))
            self.logs.warning("denied", "%s refused: %s", method, denied.message)
            return _refusing(handler, code, denied.message)
        if cached is not None:
            return cached
        gated = self._gated(full, method, role, handler)
        if len(self._handlers) < _MAX_METHODS:
            self._handlers[full] = gated
        return gated

    def _gated(
        self, full: str, method: str, role: Role, handler: grpc.RpcMethodHandler
    ) -> grpc.RpcMethodHandler:
        """The handler with the rate limit and malformed-message refusal around it."""
        if role == Role.OPEN or not full.startswith("/avest."):
            return handler
        wraps: dict[str, Wrap] = {
            "unary_unary": lambda behavior: self._unary(method, behavior),
            "unary_stream": lambda behavior: self._unary_stream(method, behavior),
            "stream_stream": lambda behavior: behavior,
        }
        return rebuilt(handler, wraps, self._parse(handler.request_deserializer))

    async def _refuse_malformed(self, method: str, request: Any, context: Any) -> None:
        """Abort the call when its request did not parse (see :meth:`_parse`)."""
        if request is MALFORMED:
            self.malformed(method)
            await context.abort(*malformed_reply())

    def _unary(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def gated(request: Any, context: Any) -> Any:
            await self._refuse_malformed(method, request, context)
            if self.rpc_rate > 0 and not self._rate_ok(peer := context.peer()):
                self.on_refused(method, "resource_exhausted")
                self.logs.warning("rate", "%s: client %s over its call rate", method, peer)
                await context.abort(*over_client_rate_reply(self.rpc_rate))
            return await behavior(request, context)

        return gated

    def _unary_stream(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def gated(request: Any, context: Any) -> Any:
            await self._refuse_malformed(method, request, context)
            async for item in behavior(request, context):
                yield item

        return gated


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> Any:
    """A handler of the same kind that refuses without reading the request."""

    async def refuse(request: Any, context: Any) -> Any:
        await context.abort(code, message)

    async def refuse_stream(request: Any, context: Any) -> Any:
        await context.abort(code, message)
        yield  # pragma: no cover - unreachable, makes this a generator

    kw = {"request_deserializer": None, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_stream, **kw)
