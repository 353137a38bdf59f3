"""The read port: ``GetCoefficients`` on a synchronous grpcio server of its own.

Why a second server: grpc.aio accepts a new call only when its event loop gets to
it. While Observe streams keep the service loop saturated, a unary call waits there
for seconds although the loop's own lag stays within tens of milliseconds
(``bench/loop_latency.py`` shows it with grpcio alone: a saturated grpc.aio server
next to a synchronous one in the same process). A synchronous server has its
own completion queue, polled by its own thread, and runs its handlers on its own
thread pool: it answers while the loop is busy.

What it serves: ``avest.v1.EstimatorService/GetCoefficients`` (every other method is
UNIMPLEMENTED there) and the standard health service, from :class:`Published`: each
pair's response, serialized once on the service loop when the pair is registered or
its coefficients change (the latest value only, as watchers get it). A handler looks
it up and returns the bytes; it touches no other state. The same tokens (the worker
role), TLS and message limits as the main port apply; a request that does not parse
is INVALID_ARGUMENT, an unknown pair NOT_FOUND with the main port's message. The main
port's per-pair call rate (``--pair-rate``) is not applied here: a call costs a lookup,
and at most :data:`MAX_CALLS` are in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from avest.grpc.convert import coefficients_pb
from avest.grpc.gate import malformed_reply
from avest.grpc.refusals import reason_of
from avest.policy.access import Access, grpc_role
from avest.policy.throttle import LogLimiter
from avest.state.app import Avest
from avest.state.pairs import Pair
from avest_wire import limits
from avest_wire.v1 import estimator_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["EstimatorService"].full_name
METHOD = f"/{SERVICE}/GetCoefficients"
#: Threads answering reads. A handler is a dict lookup, so a few keep up with any
#: caller; calls beyond :data:`MAX_CALLS` in flight are RESOURCE_EXHAUSTED at once.
THREADS = 4
MAX_CALLS = 256


def add_port(server: Any, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Have a gRPC server (synchronous or grpc.aio) listen on ``address``, over TLS with
    ``credentials``; the port bound, 0 when it cannot be bound."""
    try:
        if credentials is None:
            return int(server.add_insecure_port(address))
        return int(server.add_secure_port(address, credentials))
    except RuntimeError:  # grpcio: "Failed to bind to address ..."
        return 0


class Published:
    """Each pair's serialized ``GetCoefficientsResponse``, replaced whole on the
    service loop (registered, coefficients changed, removed) and read from any
    thread: a dict read of an immutable value needs no lock."""

    def __init__(self, app: Avest) -> None:
        self._responses: dict[str, bytes] = {}
        app.hooks.registered.append(self.publish)
        app.hooks.coefficients.append(self.publish)
        app.hooks.removed.append(lambda pair, why: self._responses.pop(pair.id, None))

    def publish(self, pair: Pair) -> None:
        self._responses[pair.id] = pb.GetCoefficientsResponse(
            coefficients=coefficients_pb(pair)
        ).SerializeToString()

    def get(self, pair_id: str) -> bytes | None:
        return self._responses.get(pair_id)


class ReadServer:
    """The synchronous grpcio server of the read port (see the module's docstring)."""

    def __init__(
        self,
        published: Published,
        access: Access,
        on_refused: Callable[[str, str], None],
        on_answered: Callable[[str, str, float], None],
        options: list[tuple[str, Any]],
    ) -> None:
        self.published = published
        self.access = access
        self.on_refused = on_refused
        self.on_answered = on_answered
        self._logs = LogLimiter("avest.grpc.reads")
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="avest-reads"),
            options=options,
            maximum_concurrent_rpcs=MAX_CALLS,
        )
        handler = grpc.unary_unary_rpc_method_handler(self._get_coefficients)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"GetCoefficients": handler}),)
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)

    def bind(self, address: str, credentials: grpc.ServerCredentials | None) -> int:
        """Listen on ``address``; the port bound, 0 when it cannot be bound."""
        return add_port(self._server, address, credentials)

    def start(self) -> None:
        self._server.start()
        for name in ("", SERVICE):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace_s: float) -> None:
        """Refuse new calls and end the server (calls in flight get ``grace_s``); returns
        at once, the server's threads finish on their own."""
        self.health.enter_graceful_shutdown()
        self._server.stop(grace_s)

    def _get_coefficients(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        answer = self._answer(request, context)
        if isinstance(answer, bytes):
            self.on_answered("GetCoefficients", "OK", time.perf_counter() - t0)
            return answer
        code, message, reason = answer
        self.on_refused("GetCoefficients", reason)
        self.on_answered("GetCoefficients", code.name, time.perf_counter() - t0)
        context.abort(code, message)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover

    def _answer(
        self, request: bytes, context: grpc.ServicerContext
    ) -> bytes | tuple[grpc.StatusCode, str, str]:
        """The response's bytes, or the status, message and counted reason that refuse
        the call."""
        authorization = next(
            (v for k, v in context.invocation_metadata() if k == "authorization"), None
        )
        denied = self.access.check(grpc_role(METHOD), authorization)
        if denied is not None:
            self._logs.warning("denied", "GetCoefficients refused: %s", denied.message)
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if denied.unauthenticated
                else grpc.StatusCode.PERMISSION_DENIED
            )
            return code, denied.message, reason_of(code)
        try:
            pair_id = pb.GetCoefficientsRequest.FromString(request).pair_id
        except (DecodeError, ValueError):
            return (*malformed_reply(), "malformed")
        if not pair_id:
            code = grpc.StatusCode.INVALID_ARGUMENT
            return code, "pair_id: must not be empty", reason_of(code)
        response = self.published.get(pair_id)
        if response is None:
            code = grpc.StatusCode.NOT_FOUND
            return code, f"unknown pair_id {limits.echo(pair_id)}", reason_of(code)
        return response
