"""The front process of ``--grpc-process``: the main port's gRPC server, and nothing else.

Started by :class:`avest.grpc.relay.RelayServer` as ``python -m avest.grpc.front FD``
on one end of a Unix socket pair. It waits for its settings (``START``: the listen
address, grpcio's server options, TLS, each method's kind), listens, says on which
port (``LISTENING``), and relays every call (:mod:`avest.grpc.relay` describes the
frames) until told to stop (``STOP``) or until the service's end of the socket closes.
Its event loop moves bytes and parses nothing, but for ``GetCoefficients``, which it
answers itself from its copy of each pair's published response (``PUBLISH``), so that
a caller polling coefficients never waits for the service's loop.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from avest.grpc.reads import COEFFICIENTS, SERVICE, ReadAnswers, ReadMethod
from avest.grpc.relay import (
    ANSWERED,
    CANCEL,
    END,
    HALF_CLOSE,
    LISTENING,
    OPEN,
    PUBLISH,
    REQUEST,
    REQUEST_ROOM,
    RESPONSE,
    RESPONSE_ROOM,
    START,
    STOP,
    WRITE_AHEAD,
    FrameProtocol,
    server_credentials,
)
from avest.policy.access import Access

#: The one method answered here: from the published bytes, as they are.
_LOCAL = {"GetCoefficients": ReadMethod(COEFFICIENTS.request, False, lambda found, r: found)}

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Call:
    """One call on its way through the front: what the service sent back, in order,
    and the room it gave for requests."""

    def __init__(self) -> None:
        self.inbox: deque[tuple[int, bytes]] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.room = 0
        self.room_waiter: asyncio.Future[None] | None = None

    def put(self, kind: int, payload: bytes) -> None:
        if kind == REQUEST_ROOM:
            self.room += payload[0]
            if self.room_waiter is not None and not self.room_waiter.done():
                self.room_waiter.set_result(None)
            return
        self.inbox.append((kind, payload))
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def next(self) -> tuple[int, bytes]:
        while not self.inbox:
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.inbox.popleft()

    async def take_room(self) -> None:
        while self.room <= 0:
            self.room_waiter = asyncio.get_running_loop().create_future()
            await self.room_waiter
        self.room -= 1


class Front:
    """The relaying handlers of every method the service serves."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.protocol = FrameProtocol(self.on_frame)
        self.calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self.started: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.stopping: asyncio.Future[float] = loop.create_future()
        #: Each pair's ``GetCoefficients`` response, as the service last published it.
        self.published: dict[str, bytes] = {}

    def on_frame(self, kind: int, call_id: int, payload: bytes) -> None:
        if kind == PUBLISH:
            pair_id, coefficients = pickle.loads(payload)
            if coefficients is None:
                self.published.pop(pair_id, None)
            else:
                self.published[pair_id] = coefficients
        elif kind == START:
            start = pickle.loads(payload)
            if start["reads"] is not None:  # as of START: the PUBLISH frames come after
                self.published.update(start["reads"][2])
            self.started.set_result(start)
        elif kind == STOP:
            if not self.stopping.done():
                self.stopping.set_result(pickle.loads(payload))
        else:
            call = self.calls.get(call_id)
            if call is not None:
                call.put(kind, payload)

    async def _pump(self, call_id: int, call: _Call, requests: AsyncIterator[bytes]) -> None:
        """Each request, once the service asks for it."""
        while True:
            await call.take_room()
            try:
                request = await requests.__anext__()
            except StopAsyncIteration:
                self.protocol.send(HALF_CLOSE, call_id)
                return
            self.protocol.send(REQUEST, call_id, request)

    async def _finish(self, context: grpc.aio.ServicerContext, payload: bytes) -> None:
        code, details, trailing = pickle.loads(payload)
        if trailing:
            context.set_trailing_metadata(trailing)
        if code != 0:
            await context.abort(_CODES.get(code, grpc.StatusCode.UNKNOWN), details)

    def answered_here(self, answers: ReadAnswers, method: str) -> grpc.RpcMethodHandler:
        """A unary read answered in this process; the service is told of it for the RPC
        metrics."""

        async def answer(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            t0 = time.perf_counter()
            got = answers.answer(method, request, context.invocation_metadata(), context.peer())
            code, message, reason = (
                (grpc.StatusCode.OK, "", None) if isinstance(got, bytes) else got
            )
            report = (method, code.name, time.perf_counter() - t0, reason)
            self.protocol.send(ANSWERED, 0, pickle.dumps(report))
            if isinstance(got, bytes):
                return got
            await context.abort(code, message)
            raise AssertionError("unreachable: abort raises")  # pragma: no cover

        return grpc.unary_unary_rpc_method_handler(answer)

    def handler(self, method: str, kind: str) -> grpc.RpcMethodHandler:
        front = self

        def open_call(context: grpc.aio.ServicerContext) -> tuple[int, _Call]:
            call_id = next(front._ids)
            call = front.calls[call_id] = _Call()
            metadata = tuple((m[0], m[1]) for m in context.invocation_metadata() or ())
            head = (method, metadata, context.peer(), context.time_remaining())
            front.protocol.send(OPEN, call_id, pickle.dumps(head))
            return call_id, call

        def start(request: Any, context: grpc.aio.ServicerContext) -> tuple[int, _Call, Any]:
            """Open the call at the service and send its request, or start pumping its
            stream of them."""
            call_id, call = open_call(context)
            if kind.startswith("unary"):
                front.protocol.send(REQUEST, call_id, request)
                front.protocol.send(HALF_CLOSE, call_id)
                return call_id, call, None
            return call_id, call, asyncio.ensure_future(front._pump(call_id, call, request))

        def forget(call_id: int, pump: asyncio.Future[None] | None) -> None:
            front.calls.pop(call_id, None)
            if pump is not None:
                pump.cancel()

        async def one_response(request: Any, context: grpc.aio.ServicerContext) -> bytes | None:
            call_id, call, pump = start(request, context)
            response = None
            try:
                while True:
                    got, payload = await call.next()
                    if got == RESPONSE:
                        response = payload
                    elif got == END:
                        await front._finish(context, payload)
                        return response
            except asyncio.CancelledError:
                front.protocol.send(CANCEL, call_id)
                raise
            finally:
                forget(call_id, pump)

        async def responses(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            call_id, call, pump = start(request, context)
            ended, written = b"", 0
            try:
                while True:
                    got, payload = await call.next()
                    if got == RESPONSE:
                        yield payload
                        written += 1
                        if written == WRITE_AHEAD:
                            front.protocol.send(RESPONSE_ROOM, call_id, bytes((written,)))
                            written = 0
                    elif got == END:
                        ended = payload
                        break
            except (asyncio.CancelledError, GeneratorExit):
                front.protocol.send(CANCEL, call_id)
                raise
            finally:
                forget(call_id, pump)
            await front._finish(context, ended)

        factory: Callable[..., grpc.RpcMethodHandler] = {
            "unary_unary": grpc.unary_unary_rpc_method_handler,
            "stream_unary": grpc.stream_unary_rpc_method_handler,
            "unary_stream": grpc.unary_stream_rpc_method_handler,
            "stream_stream": grpc.stream_stream_rpc_method_handler,
        }[kind]
        behavior = one_response if kind in ("unary_unary", "stream_unary") else responses
        return factory(behavior)


class _Methods(grpc.GenericRpcHandler):
    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.handlers = handlers

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self.handlers.get(details.method)


async def _serve(fd: int) -> None:
    loop = asyncio.get_running_loop()
    front = Front()
    sock = socket.socket(fileno=fd)
    await loop.create_unix_connection(lambda: front.protocol, sock=sock)
    start = await asyncio.wait_for(asyncio.shield(front.started), timeout=60)
    server = grpc.aio.server(
        options=start["options"], maximum_concurrent_rpcs=start["maximum_concurrent_rpcs"]
    )
    handlers = {m: front.handler(m, kind) for m, kind in start["kinds"].items()}
    if start["reads"] is not None:
        (worker_token, admin_token), rpc_rate, _ = start["reads"]
        answers = ReadAnswers(
            _LOCAL, front.published.get, Access(worker_token, admin_token), rpc_rate, 0.0,
            "avest.grpc.front", "the gRPC front",
        )  # fmt: skip
        for name in _LOCAL:
            handlers[f"/{SERVICE}/{name}"] = front.answered_here(answers, name)
    server.add_generic_rpc_handlers((_Methods(handlers),))
    tls = start["tls"]
    try:
        if tls is None:
            port = server.add_insecure_port(start["address"])
        else:
            port = server.add_secure_port(start["address"], server_credentials(*tls))
    except RuntimeError:  # grpcio: "Failed to bind to address ..."
        port = 0
    if port:
        await server.start()
    front.protocol.send(LISTENING, 0, pickle.dumps(port))
    if not port:
        return
    done, _ = await asyncio.wait(
        (front.stopping, front.protocol.closed), return_when=asyncio.FIRST_COMPLETED
    )
    grace = front.stopping.result() if front.stopping in done else 0.0
    await server.stop(grace)


def main() -> None:
    # The service stops this process (STOP, or its end of the socket closing): a
    # Ctrl-C or a SIGTERM sent to the whole process group is the service's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    asyncio.run(_serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
