"""gRPC calls relayed from a front process, so that gRPC's own I/O has a core of its own.

With ``--grpc-process`` the main port's ``grpc.aio`` server runs in a process of its
own (:mod:`avest.grpc.front`), whose event loop does nothing but gRPC: it takes each
call, and relays its requests' bytes, its metadata and its peer over one Unix socket to
this process, where the servicer, the gate and the timing interceptor run exactly as
they do on an in-process server. Their responses, status and trailing metadata go back
the same way. The service's loop then never holds gRPC's completions up: however busy
the owners keep it, every call reaches the front at once, and the front hands it over
in the next turn here.

Flow control stays what gRPC gives: the front reads a stream's requests only as far
as the handler here gave room (``REQUEST_ROOM``, :data:`READ_AHEAD` ahead of what it
took), and the handler here makes responses only :data:`WRITE_AHEAD` ahead of what the
front has written (``RESPONSE_ROOM``). A pair's queue that is full still stops reading
its streams, and a slow reader still gets the latest value, not a backlog.

One method the front answers itself: ``GetCoefficients``, from its copy of each pair's
published response (``PUBLISH``, sent here as each pair changes, the read port's
:class:`avest.grpc.reads.Published`), with the same token, rate and refusal checks as
the read port (:class:`avest.grpc.reads.ReadAnswers`). A caller polling coefficients so
never waits for this process's loop; each answer is reported back (``ANSWERED``) for
the RPC metrics. Its copy is behind this process's by one frame: a change made through
the front (a refit acknowledged on a stream, a ``RegisterPair``) reaches it before that
call's answer does, one made through the admin API may not yet have.

The frames (both ways): a header (payload length, kind, call id) and the payload.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

log = logging.getLogger("avest.grpc")

HEADER = struct.Struct("!IBI")
# front -> service
OPEN = 1  # pickled (method, metadata, peer, seconds left or None)
REQUEST = 2  # a request's bytes
HALF_CLOSE = 3  # no more requests
CANCEL = 4  # the client went away (or its deadline passed)
RESPONSE_ROOM = 5  # this many more responses written (one byte): make as many more
LISTENING = 6  # (call 0) the pickled port bound, 0 when it could not bind
ANSWERED = 7  # (call 0) pickled (method, status name, seconds, refusal reason or None)
# service -> front
RESPONSE = 11  # a response's bytes
END = 12  # pickled (status code value, details, trailing metadata)
REQUEST_ROOM = 13  # read as many more of the call's requests (one byte)
START = 14  # (call 0) pickled: the front's settings and each method's kind
STOP = 15  # (call 0) pickled grace seconds: stop the server and exit
PUBLISH = 16  # (call 0) pickled (pair id, its GetCoefficients bytes or None: removed)

#: Requests of one stream read ahead of its handler: enough to keep a stream's messages
#: flowing while the last ones are handed over, few enough that a stream whose pair's
#: queue is full holds only this many here (the rest wait in HTTP/2's window).
READ_AHEAD = 4
#: Responses of one stream made ahead of what the front has written: a stream whose
#: client reads slowly holds at most this many in the front (the latest value waits
#: here). Room comes back in lots of this size, one frame for each.
WRITE_AHEAD = 2


def server_credentials(key: bytes, cert: bytes, ca: bytes | None) -> grpc.ServerCredentials:
    """TLS for a gRPC server, mutual when a client CA is given."""
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def frame(kind: int, call: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind, call) + payload


class FrameProtocol(asyncio.Protocol):
    """Frames in from one socket, each handed to ``on_frame`` as it completes;
    ``send`` writes one. ``closed`` is set when the socket closes."""

    def __init__(self, on_frame: Callable[[int, int, bytes], None]) -> None:
        self.on_frame = on_frame
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buffer
        buf += data
        at = 0
        size = HEADER.size
        while len(buf) - at >= size:
            length, kind, call = HEADER.unpack_from(buf, at)
            end = at + size + length
            if len(buf) < end:
                break
            self.on_frame(kind, call, bytes(buf[at + size : end]))
            at = end
        if at:
            del buf[:at]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(exc)

    def send(self, kind: int, call: int, payload: bytes = b"") -> None:
        """Queue one frame; what a turn of the loop queues goes out in one write."""
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(frame(kind, call, payload))

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(out))


class _Details(NamedTuple):
    """What ``grpc.HandlerCallDetails`` carries, for the interceptors."""

    method: str
    invocation_metadata: tuple[tuple[str, str | bytes], ...]


class RelayContext:
    """The servicer context of a relayed call: what the gate, the interceptor and the
    servicers use of ``grpc.aio.ServicerContext``."""

    def __init__(
        self, call: RelayedCall, metadata: Sequence[tuple[str, Any]], peer: str, left: float | None
    ) -> None:
        self._call = call
        self._metadata = tuple(metadata)
        self._peer = peer
        self._deadline = None if left is None else time.monotonic() + left
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, Any], ...] = ()

    def invocation_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self._code, self._details = code, details
        if trailing_metadata:
            self._trailing = tuple(trailing_metadata)
        raise grpc.aio.AbortError(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, Any]]) -> None:
        self._trailing = tuple(metadata)

    async def write(self, message: Any) -> None:
        await self._call.respond(message)

    def cancelled(self) -> bool:
        return self._call.cancelled

    def done(self) -> bool:
        return self._call.ended


class _Requests:
    """A relayed call's requests, read from the front one at a time as asked for."""

    def __init__(self, call: RelayedCall) -> None:
        self._call = call
        self.queue: deque[bytes | None] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self._asked = False
        self._taken = 0
        self._over = False

    def put(self, payload: bytes | None) -> None:
        self.queue.append(payload)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> Any:
        while not self.queue:
            if self._over:
                raise StopAsyncIteration
            if not self._asked:  # the first ask: room for READ_AHEAD
                self._asked = True
                self._call.host.send(REQUEST_ROOM, self._call.id, bytes((READ_AHEAD,)))
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        payload = self.queue.popleft()
        if payload is not None and self._asked:  # room again, in lots of half the window
            self._taken += 1
            if self._taken * 2 >= READ_AHEAD:
                self._call.host.send(REQUEST_ROOM, self._call.id, bytes((self._taken,)))
                self._taken = 0
        if payload is None:
            self._over = True
            raise StopAsyncIteration
        return self._call.parse(payload)


class RelayedCall:
    """One call relayed from the front: its handler runs as a task of this loop."""

    def __init__(
        self,
        host: RelayHost,
        call_id: int,
        method: str,
        metadata: Any,
        peer: str,
        left: float | None,
    ) -> None:
        self.host = host
        self.id = call_id
        self.method = method
        self.context = RelayContext(self, metadata, peer, left)
        self.requests = _Requests(self)
        self.room = WRITE_AHEAD
        self._room_waiter: asyncio.Future[None] | None = None
        self.cancelled = False
        self.ended = False
        self.parse: Callable[[bytes], Any] = bytes
        self._serialize: Callable[[Any], bytes] | None = None
        self.task: asyncio.Task[None] | None = None

    def more_room(self, written: int) -> None:
        self.room += written
        if self._room_waiter is not None and not self._room_waiter.done():
            self._room_waiter.set_result(None)

    async def respond(self, message: Any) -> None:
        """Send one response once the front has written the last."""
        while self.room <= 0:
            self._room_waiter = asyncio.get_running_loop().create_future()
            await self._room_waiter
        self.room -= 1
        host = self.host
        if message is host.last_response:  # one push to many streams: serialized once
            data = host.last_bytes
        else:
            data = message if self._serialize is None else self._serialize(message)
            host.last_response, host.last_bytes = message, data
        host.send(RESPONSE, self.id, data)

    async def run(self) -> None:
        ctx = self.context
        code: grpc.StatusCode = grpc.StatusCode.OK
        try:
            handler = await self.host.resolve(_Details(self.method, ctx.invocation_metadata()))
            if handler is None:
                code, ctx._details = grpc.StatusCode.UNIMPLEMENTED, "Method not found!"
                return
            if handler.request_deserializer is not None:
                self.parse = handler.request_deserializer
            self._serialize = handler.response_serializer
            await self._serve(handler)
            code = ctx.code() or grpc.StatusCode.OK
        except grpc.aio.AbortError:
            code = ctx.code() or grpc.StatusCode.UNKNOWN
        except asyncio.CancelledError:
            code, ctx._details = grpc.StatusCode.CANCELLED, "Cancelled"
            if not self.cancelled:  # stopped here: tell the front
                raise
        except Exception:
            log.exception("a relayed call of %s failed", self.method)
            code, ctx._details = grpc.StatusCode.UNKNOWN, "Unexpected error"
        finally:
            self.ended = True
            self.host.end(self, code)

    async def _serve(self, handler: grpc.RpcMethodHandler) -> None:
        if handler.unary_unary is not None or handler.unary_stream is not None:
            request: Any = await self.requests.__anext__()
        else:
            request = self.requests
        behavior = (
            handler.unary_unary
            or handler.stream_unary
            or handler.unary_stream
            or handler.stream_stream
        )
        result = behavior(request, self.context)
        if handler.unary_unary is not None or handler.stream_unary is not None:
            response = await result
            if response is not None:
                await self.respond(response)
        elif hasattr(result, "__aiter__"):
            async for response in result:
                await self.respond(response)
        else:  # a streaming handler that writes with context.write()
            await result


class RelayHost:
    """This process's end of the relay: the calls the front hands over, each run
    through ``resolve`` (the interceptors, then the registered handlers)."""

    def __init__(
        self, resolve: Callable[[_Details], Awaitable[grpc.RpcMethodHandler | None]]
    ) -> None:
        self.resolve = resolve
        self.calls: dict[int, RelayedCall] = {}
        self.protocol: FrameProtocol | None = None
        self.listening: asyncio.Future[tuple[int, str]] | None = None
        #: Told of each call the front answered itself: method, status, seconds, reason.
        self.answered: Callable[[str, str, float, str | None], None] | None = None
        #: The last response sent, serialized.
        self.last_response: Any = None
        self.last_bytes = b""

    def send(self, kind: int, call: int, payload: bytes = b"") -> None:
        if self.protocol is not None:
            self.protocol.send(kind, call, payload)

    def end(self, call: RelayedCall, code: grpc.StatusCode) -> None:
        if self.calls.pop(call.id, None) is None or call.cancelled:
            return
        ctx = call.context
        self.send(END, call.id, pickle.dumps((code.value[0], ctx.details(), ctx._trailing)))

    def on_frame(self, kind: int, call_id: int, payload: bytes) -> None:
        if kind == OPEN:
            method, metadata, peer, left = pickle.loads(payload)
            call = self.calls[call_id] = RelayedCall(self, call_id, method, metadata, peer, left)
            call.task = asyncio.get_running_loop().create_task(call.run())
            return
        if kind == LISTENING:
            if self.listening is not None and not self.listening.done():
                self.listening.set_result(pickle.loads(payload))
            return
        if kind == ANSWERED:
            if self.answered is not None:
                self.answered(*pickle.loads(payload))
            return
        call = self.calls.get(call_id)
        if call is None:  # ended here already
            return
        if kind == REQUEST:
            call.requests.put(payload)
        elif kind == HALF_CLOSE:
            call.requests.put(None)
        elif kind == RESPONSE_ROOM:
            call.more_room(payload[0])
        elif kind == CANCEL:
            call.cancelled = True
            if call.task is not None:
                call.task.cancel()

    def cancel_all(self) -> None:
        for call in list(self.calls.values()):
            call.cancelled = True
            if call.task is not None:
                call.task.cancel()


def method_kinds(services: Sequence[Any]) -> dict[str, str]:
    """Each method's kind, ``/package.Service/Method`` -> ``unary_stream`` etc., from
    the services' protobuf descriptors."""
    kinds = {}
    for service in services:
        for m in service.methods:
            streams = (
                "stream" if m.client_streaming else "unary",
                "stream" if m.server_streaming else "unary",
            )
            kinds[f"/{service.full_name}/{m.name}"] = "_".join(streams)
    return kinds


@dataclass(frozen=True)
class FrontReads:
    """What the front needs to answer ``GetCoefficients`` itself."""

    #: the worker's and the admin's token
    tokens: tuple[str, str]
    #: ``--rpc-rate``: the front keeps its own buckets, as the read port does
    rpc_rate: float
    #: each pair's ``GetCoefficients`` bytes as of now
    published: Callable[[], dict[str, bytes]]


class RelayServer(grpc.aio.Server):  # type: ignore[misc]
    """A ``grpc.aio.Server`` whose handlers and interceptors run here, while a front
    process (:mod:`avest.grpc.front`) listens and relays the calls: :meth:`listen` in
    place of ``add_insecure_port`` / ``add_secure_port``."""

    def __init__(
        self,
        interceptors: Sequence[grpc.aio.ServerInterceptor],
        options: Sequence[tuple[str, Any]],
        maximum_concurrent_rpcs: int | None,
        services: Sequence[Any],
    ) -> None:
        self.interceptors = tuple(interceptors)
        self.options = list(options)
        self.maximum_concurrent_rpcs = maximum_concurrent_rpcs
        self.kinds = method_kinds(services)
        self._generic: list[grpc.GenericRpcHandler] = []
        self.host = RelayHost(self._resolve)
        self._process: asyncio.subprocess.Process | None = None
        self._stopped = False
        #: Set when the front process is gone while this one was not stopping it.
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        """The generic handlers added with them already serve these."""

    async def _lookup(self, details: _Details) -> grpc.RpcMethodHandler | None:
        for generic in self._generic:
            handler = generic.service(details)  # type: ignore[arg-type]
            if handler is not None:
                return handler
        return None

    async def _resolve(self, details: _Details) -> grpc.RpcMethodHandler | None:
        """The handler of a call, through the interceptors as grpc.aio applies them
        (the first one outermost)."""
        continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler | None]] = self._lookup
        for interceptor in reversed(self.interceptors):
            continuation = _intercepted(interceptor, continuation)
        return await continuation(details)

    @property
    def pid(self) -> int | None:
        """The front process's id, once started."""
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        """The front serves from :meth:`listen` on."""

    def add_insecure_port(self, address: str) -> int:
        raise NotImplementedError("the front process listens: use listen()")

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        raise NotImplementedError("the front process listens: use listen()")

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        if self._process is None:
            return True
        try:
            await asyncio.wait_for(self._process.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def listen(
        self,
        address: str,
        tls: tuple[bytes, bytes, bytes | None] | None,
        reads: FrontReads | None = None,
    ) -> int:
        """Start the front process listening on ``address`` (TLS: key, certificate and
        client CA): the port it bound, 0 when it could not. With ``reads``, the front
        answers ``GetCoefficients`` itself; :meth:`publish` then keeps its copy."""
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with theirs:
            self._process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "avest.grpc.front", str(theirs.fileno()),
                pass_fds=(theirs.fileno(),), env=os.environ.copy(),
            )  # fmt: skip
        self.host.protocol = FrameProtocol(self.host.on_frame)
        self.host.listening = loop.create_future()
        await loop.create_unix_connection(lambda: self.host.protocol, sock=ours)  # type: ignore[arg-type, return-value]
        start = {
            "address": address,
            "options": self.options,
            "maximum_concurrent_rpcs": self.maximum_concurrent_rpcs,
            "tls": tls,
            "kinds": self.kinds,
            # what is published from here on is sent after this
            "reads": None if reads is None else (reads.tokens, reads.rpc_rate, reads.published()),
        }
        self.host.send(START, 0, pickle.dumps(start))
        closed = self.host.protocol.closed
        done, _ = await asyncio.wait(
            (self.host.listening, closed), timeout=60, return_when=asyncio.FIRST_COMPLETED
        )
        port = int(self.host.listening.result()) if self.host.listening in done else 0
        if port:
            closed.add_done_callback(self._closed)
        else:
            await self.stop(0)
        return port

    def publish(self, pair_id: str, coefficients: bytes | None) -> None:
        """A pair's new ``GetCoefficients`` bytes (None: removed), for the front's copy."""
        self.host.send(PUBLISH, 0, pickle.dumps((pair_id, coefficients)))

    def _closed(self, _: Any) -> None:
        self.host.cancel_all()
        if not self._stopped and not self.lost.done():
            log.error("the gRPC front process exited: the main port is no longer served")
            self.lost.set_result(None)

    async def stop(self, grace: float | None) -> None:
        """Stop the front within ``grace`` seconds (its calls in flight end as cancelled
        after that), and wait for it to exit."""
        self._stopped = True
        process = self._process
        if process is None:
            return
        self.host.send(STOP, 0, pickle.dumps(grace or 0.0))
        try:
            await asyncio.wait_for(process.wait(), timeout=(grace or 0.0) + 5.0)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
        self.host.cancel_all()
        if self.host.protocol is not None and self.host.protocol.transport is not None:
            self.host.protocol.transport.close()


def _intercepted(
    interceptor: grpc.aio.ServerInterceptor,
    continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler | None]],
) -> Callable[[Any], Awaitable[grpc.RpcMethodHandler | None]]:
    async def intercepted(details: Any) -> grpc.RpcMethodHandler | None:
        return await interceptor.intercept_service(continuation, details)  # type: ignore[no-any-return]

    return intercepted
