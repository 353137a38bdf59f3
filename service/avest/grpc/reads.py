"""The read port: ``GetCoefficients``, ``Score`` and ``Budget`` on a synchronous grpcio
server of its own.

Why a second server: grpc.aio accepts a new call only when its event loop gets to
it. While Observe streams keep the service loop saturated, a unary call waits there
for seconds although the loop's own lag stays within tens of milliseconds
(``bench/loop_latency.py`` shows it with grpcio alone: a saturated grpc.aio server
next to a synchronous one in the same process). A synchronous server has its
own completion queue, polled by its own thread, and runs its handlers on its own
thread pool: it answers while the loop is busy.

What it serves: those three methods of ``avest.v1.EstimatorService`` (every other is
UNIMPLEMENTED there) and the standard health service, from :class:`Published`: each
pair's ``GetCoefficientsResponse`` serialized, and what it serves frozen
(``ServedModel``: coefficients, the calibration layer's table while served, version),
both taken on the service loop when the pair is registered or its coefficients change
(the latest value only, as watchers get it). ``GetCoefficients`` returns the bytes;
``Score`` and ``Budget`` compute from the frozen model (:mod:`avest.grpc.budgets`, as
the main port does from the pair as it is), ``Budget`` with the pair's current cost
tables. Between refits the two ports can differ in whether the calibration layer is
served (:mod:`avest.grpc.budgets`). The same tokens (the worker role), TLS, message and
row limits, refusal codes and messages as the main port apply, and the call rates with
buckets of the read port's own: ``--rpc-rate`` per client address, ``--pair-rate`` to
``Score`` and ``Budget`` (a ``GetCoefficients`` is a lookup). At most :data:`MAX_CALLS`
calls are in flight; one that fails unexpectedly is INTERNAL, logged and counted.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from avest.core.estimator import ServedModel
from avest.grpc import budgets
from avest.grpc.convert import coefficients_pb
from avest.grpc.gate import client_host, malformed_reply, over_client_rate_reply
from avest.grpc.limits import StreamLimits
from avest.grpc.refusals import Refused, over_pair_rate, reason_of, refusals
from avest.policy.access import Access, grpc_role
from avest.policy.throttle import KeyedRates, LogLimiter
from avest.state.app import Avest
from avest.state.pairs import Pair
from avest_wire import limits
from avest_wire.v1 import estimator_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["EstimatorService"].full_name
#: Threads answering reads. A GetCoefficients is a dict lookup and a Score or Budget
#: some numpy over one message's rows, so a few keep up; calls beyond
#: :data:`MAX_CALLS` in flight are RESOURCE_EXHAUSTED at once.
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


@dataclass(frozen=True)
class Entry:
    """A pair as the read port serves it, as of its last change."""

    #: the serialized ``GetCoefficientsResponse``
    coefficients: bytes
    served: ServedModel
    #: for its cost tables alone (``Pair.cost_table`` only reads, from any thread)
    pair: Pair


class Published:
    """Each pair's :class:`Entry`, replaced whole on the service loop (registered,
    coefficients changed, removed) and read from any thread: a dict read of an
    immutable value needs no lock."""

    def __init__(self, app: Avest) -> None:
        self._entries: dict[str, Entry] = {}
        #: Told each pair's new ``GetCoefficients`` bytes (None: the pair is gone), on
        #: the service loop: the gRPC front keeps its copy so.
        self.listeners: list[Callable[[str, bytes | None], None]] = []
        app.hooks.registered.append(self.publish)
        app.hooks.coefficients.append(self.publish)
        app.hooks.removed.append(self._remove)

    def publish(self, pair: Pair) -> None:
        response = pb.GetCoefficientsResponse(
            coefficients=coefficients_pb(pair)
        ).SerializeToString()
        self._entries[pair.id] = Entry(response, pair.estimator.served(), pair)
        for listener in self.listeners:
            listener(pair.id, response)

    def _remove(self, pair: Pair, why: str) -> None:
        self._entries.pop(pair.id, None)
        for listener in self.listeners:
            listener(pair.id, None)

    def coefficients(self) -> dict[str, bytes]:
        """Each pair's ``GetCoefficients`` bytes, as of now."""
        return {pair_id: entry.coefficients for pair_id, entry in self._entries.items()}

    def get(self, pair_id: str) -> Entry | None:
        return self._entries.get(pair_id)


@dataclass(frozen=True)
class ReadMethod:
    """How a read is answered from what a pair published."""

    #: the request's message type
    request: Any
    #: under ``--pair-rate`` (a ``GetCoefficients`` is a lookup: it is not)
    rated: bool
    #: the response's bytes, from what the lookup found and the parsed request
    answer: Callable[[Any, Any], bytes]


#: ``GetCoefficients``: the bytes published, as they are.
COEFFICIENTS = ReadMethod(pb.GetCoefficientsRequest, False, lambda found, r: found.coefficients)

#: A refusal: its status, its message, the reason it is counted under.
Refusal = tuple[grpc.StatusCode, str, str]


class ReadAnswers:
    """What the read port and the gRPC front (:mod:`avest.grpc.front`, which answers
    ``GetCoefficients`` itself) decide for a read: the token, the request's form, the
    client's call rate, the pair, the pair's call rate, then the answer. Thread-safe:
    the buckets are taken under a lock."""

    def __init__(
        self,
        methods: dict[str, ReadMethod],
        lookup: Callable[[str], Any | None],
        access: Access,
        rpc_rate: float,
        pair_rate: float,
        logger: str,
        where: str,
    ) -> None:
        self.methods = methods
        self.lookup = lookup
        self.access = access
        self.rpc_rate = rpc_rate
        self.client_rates = KeyedRates(rpc_rate)
        self.pair_rates = KeyedRates(pair_rate)
        self._rates_lock = threading.Lock()
        self._logs = LogLimiter(logger)
        self.where = where

    def answer(self, method: str, request: bytes, metadata: Any, peer: str) -> bytes | Refusal:
        """The response's bytes, or the refusal."""
        authorization = next((v for k, v in metadata or () if k == "authorization"), None)
        denied = self.access.check(grpc_role(f"/{SERVICE}/{method}"), authorization)
        if denied is not None:
            self._logs.warning("denied", "%s refused: %s", method, denied.message)
            code = (
                grpc.StatusCode.UNAUTHENTICATED
                if denied.unauthenticated
                else grpc.StatusCode.PERMISSION_DENIED
            )
            return code, denied.message, reason_of(code)
        how = self.methods[method]
        try:
            parsed = how.request.FromString(request)
        except (DecodeError, ValueError):
            return (*malformed_reply(), "malformed")
        if not self._take(self.client_rates, client_host(peer)):
            self._logs.warning("rate", "%s: client %s over its call rate", method, peer)
            code, message = over_client_rate_reply(self.rpc_rate)
            return code, message, reason_of(code)
        pair_id = parsed.pair_id
        if not pair_id:
            code = grpc.StatusCode.INVALID_ARGUMENT
            return code, "pair_id: must not be empty", reason_of(code)
        found = self.lookup(pair_id)
        if found is None:
            code = grpc.StatusCode.NOT_FOUND
            return code, f"unknown pair_id {limits.echo(pair_id)}", reason_of(code)
        try:
            with refusals():
                if how.rated and not self._take(self.pair_rates, pair_id):
                    self._logs.warning("pair_rate", "pair %s over its call rate", pair_id)
                    raise over_pair_rate(self.pair_rates.rate, pair_id)
                return how.answer(found, parsed)
        except Refused as r:
            return r.code, r.message, r.reason
        except Exception as exc:  # a bug: say so (rate-limited), answer INTERNAL, count it
            self._logs.warning("internal", "%s failed on %s: %r", method, self.where, exc)
            code = grpc.StatusCode.INTERNAL
            return code, f"{method} failed on {self.where}; see the service's log", "internal"

    def _take(self, rates: KeyedRates, key: str) -> bool:
        with self._rates_lock:
            return rates.take(key)


class ReadServer:
    """The synchronous grpcio server of the read port (see the module's docstring)."""

    def __init__(
        self,
        published: Published,
        access: Access,
        on_refused: Callable[[str, str], None],
        on_answered: Callable[[str, str, float], None],
        options: list[tuple[str, Any]],
        stream_limits: StreamLimits,
        rpc_rate: float,
    ) -> None:
        self.published = published
        self.on_refused = on_refused
        self.on_answered = on_answered
        self._threads = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="avest-reads")
        self._server = grpc.server(
            self._threads,
            options=options,
            maximum_concurrent_rpcs=MAX_CALLS,
        )
        max_rows = stream_limits.max_rows
        self._methods = {
            "GetCoefficients": COEFFICIENTS,
            "Score": ReadMethod(
                pb.ScoreRequest,
                True,
                lambda e, r: budgets.score(e.served, r, max_rows).SerializeToString(),
            ),
            "Budget": ReadMethod(
                pb.BudgetRequest,
                True,
                lambda e, r: budgets.budget(
                    e.served.k, lambda: e.served, e.pair.cost_table, r, max_rows
                ).SerializeToString(),
            ),
        }
        assert set(self._methods) == limits.READ_PORT_METHODS, "the contract's read methods"
        self.answers = ReadAnswers(
            self._methods, published.get, access, rpc_rate, stream_limits.pair_rate,
            "avest.grpc.reads", "the read port",
        )  # fmt: skip
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(functools.partial(self._call, name))
            for name in self._methods
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
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

    def stop(self, grace_s: float) -> threading.Event:
        """Refuse new calls and end the server (calls in flight get ``grace_s``); returns
        at once, with the event set once the server has ended (then :meth:`close`)."""
        self.health.enter_graceful_shutdown()
        return self._server.stop(grace_s)

    def close(self) -> None:
        """End the server's threads (after :meth:`stop`'s event)."""
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _call(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        answer = self.answers.answer(method, request, context.invocation_metadata(), context.peer())
        if isinstance(answer, bytes):
            self.on_answered(method, "OK", time.perf_counter() - t0)
            return answer
        code, message, reason = answer
        self.on_refused(method, reason)
        self.on_answered(method, code.name, time.perf_counter() - t0)
        context.abort(code, message)
        raise AssertionError("unreachable: abort raises")  # pragma: no cover
