"""One Observe call: check each message once, hand it to its pair's owner, push
acknowledgements and coefficient updates (the latest of each, never a backlog).

The stream itself only reads, checks and writes. What it reads goes to the pair's
bounded queue (:mod:`avest.state.admission`); while that queue is full the stream
reads nothing more, and HTTP/2 flow control holds its sender back."""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from avest.grpc.gate import MALFORMED, malformed_reply
from avest.grpc.limits import StreamLimits
from avest.grpc.refusals import Refused, refusals
from avest.policy.throttle import LogLimiter
from avest.state.app import Avest
from avest.state.pairs import Pair
from avest_wire import limits, refusal
from avest_wire.errors import InvalidInput
from avest_wire.v1 import estimator_pb2 as pb

log = logging.getLogger("avest.grpc")
#: Seconds a stream that ends waits for its last messages to be applied (so that
#: the flush after it acknowledges them) before it closes anyway.
SETTLE_S = 5.0
#: Steps taken for duplicates on a stream that never told their worker its watermark.
_stale = LogLimiter("avest.grpc")
#: The fields of an ObserveRequest that carry a step: an opening request sets none.
_STEP_FIELDS = (
    "sequence", "features", "rows", "k", "num_verified", "num_accepted", "exclude",
    "coefficients_version", "summary", "strata", "stratum_index",
)  # fmt: skip


class StreamHost(Protocol):
    """What a stream needs from the service that opened it (the gRPC servicer)."""

    app: Avest
    limits: StreamLimits
    streams: set[ObserveStream]
    open_streams: int
    draining: bool
    on_refused: Callable[[str, str], None]
    #: (pair_id, worker_id) -> the open stream sending as that worker.
    owners: dict[tuple[str, str], ObserveStream]
    #: pair_id -> how many of its workers open streams send as (``owners``' count).
    streaming: collections.Counter[str]
    #: pair_id -> its latest coefficients push (the coefficients and sketch rate it was
    #: made of), made once for all its streams.
    updates: dict[str, tuple[pb.Coefficients, int, pb.ObserveResponse]]

    def malformed(self, method: str) -> None: ...

    def validate_observe(self, req: pb.ObserveRequest) -> tuple[Pair, Any, Any]: ...


class ObserveStream:
    """One Observe call: applies steps as they arrive, pushes acks and updates."""

    def __init__(
        self,
        service: StreamHost,
        requests: AsyncIterator[pb.ObserveRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        self.service = service
        self.requests = requests
        self.context = context
        #: What to send, in order; a pair id stands for its latest unsent
        #: coefficients and a (pair id, worker id) for its latest unsent ack, so a
        #: stream whose client reads slowly (or never) holds one of each, not one
        #: per refit or flush.
        self.out: asyncio.Queue[pb.ObserveResponse | str | tuple[str, str] | None] = asyncio.Queue()
        self._coefficients: dict[str, pb.Coefficients] = {}
        #: Per pair, when its coefficients were last sent on this stream (loop time).
        self._pushed: dict[str, float] = {}
        self._acks: dict[tuple[str, str], int] = {}
        #: (pair_id, worker_id) -> highest sequence acknowledged on this stream.
        self.acked: dict[tuple[str, str], int] = {}
        self.pairs: set[str] = set()
        #: Worker ids this stream holds (no other stream may send as them meanwhile).
        self.claimed: set[tuple[str, str]] = set()
        #: Workers opened on this stream (told their watermark before any step).
        self.opened: set[tuple[str, str]] = set()
        self.error: Refused | None = None
        #: Per pair, the last message handed to its owner (resolved once applied).
        self.last: dict[str, asyncio.Future[bool]] = {}
        #: Pairs whose first worker on this stream is being opened: their coefficients
        #: wait until its opening is sent (the first answer a worker reads; a replica
        #: reads the watermark from PostgreSQL, and a refit can be pushed meanwhile).
        self._opening: set[str] = set()

    def coefficients(self, pair_id: str, msg: pb.Coefficients) -> None:
        """Queue ``pair_id``'s new coefficients: the latest only, sent at most once per
        :meth:`StreamLimits.push_every` (a later refit's replace one not yet sent)."""
        if pair_id not in self.pairs:
            return
        queued = pair_id in self._coefficients
        self._coefficients[pair_id] = msg
        if queued or pair_id in self._opening:
            return
        loop = asyncio.get_running_loop()
        every = self.service.limits.push_every(self.service.streaming[pair_id])
        wait = self._pushed.get(pair_id, -math.inf) + every
        if wait <= loop.time():
            self.out.put_nowait(pair_id)
        else:
            loop.call_at(wait, self.out.put_nowait, pair_id)

    def durable(self, pair_id: str, worker: str, level: int) -> None:
        """``worker``'s steps of ``pair_id`` are durable up to ``level``: queue its ack."""
        key = (pair_id, worker)
        sent = self.acked.get(key)
        if sent is None or level <= sent:
            return
        self.acked[key] = level
        if key not in self._acks:
            self.out.put_nowait(key)
        self._acks[key] = level

    def _response(self, msg: pb.ObserveResponse | str | tuple[str, str]) -> pb.ObserveResponse:
        if isinstance(msg, str):
            coefficients = self._coefficients.pop(msg)
            self._pushed[msg] = asyncio.get_running_loop().time()
            every = self._sketch_every(msg)
            # one message per refit for every stream of the pair, not one each
            made = self.service.updates.get(msg)
            if made is None or made[0] is not coefficients or made[1] != every:
                update = pb.CoefficientsUpdate(coefficients=coefficients, sketch_every=every)
                made = (coefficients, every, pb.ObserveResponse(coefficients_update=update))
                self.service.updates[msg] = made
            return made[2]
        if isinstance(msg, tuple):
            level = self._acks.pop(msg)
            return pb.ObserveResponse(
                ack=pb.Ack(pair_id=msg[0], worker_id=msg[1], acked_sequence=level)
            )
        return msg

    def _sketch_every(self, pair_id: str) -> int:
        """What the pair's workers are asked now: a sketch with one round in how many."""
        return self.service.limits.sketch_every(self.service.streaming[pair_id])

    def close(self) -> None:
        self.out.put_nowait(None)

    def _claim(self, pair_id: str, worker_id: str) -> None:
        key = (pair_id, worker_id)
        if key in self.claimed:
            return
        owner = self.service.owners.get(key)
        if owner is not None and owner is not self:
            raise Refused(
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker id collision: worker {limits.echo(worker_id)} of pair {pair_id} is "
                "sending on another open stream; give each sender its own worker_id",
            )
        self.service.owners[key] = self
        self.service.streaming[pair_id] += 1
        self.claimed.add(key)

    async def _open(self, req: pb.ObserveRequest) -> None:
        """Open a worker (``ObserveRequest.open``): claim it for this stream and answer
        with what the pair holds of it, before any of its steps is applied here."""
        with refusals():
            problem = limits.worker_id_problem(req.worker_id)
            if problem is not None:
                raise InvalidInput("worker_id", problem)
            for name in _STEP_FIELDS:
                field = getattr(req, name)
                if req.HasField(name) if name in ("coefficients_version", "summary") else field:
                    raise InvalidInput(name, "must be empty in a request that opens a worker")
            pair = self.service.app.registry.get(req.pair_id)
        self._claim(pair.id, req.worker_id)
        key = (pair.id, req.worker_id)
        first = pair.id not in self.pairs
        if first:
            self._opening.add(pair.id)
        self.pairs.add(pair.id)
        self.opened.add(key)
        try:
            with refusals():
                applied, durable = await self.service.app.watermark(pair, req.worker_id)
        finally:
            self._opening.discard(pair.id)
        self.acked[key] = max(self.acked.get(key, 0), durable)
        self.out.put_nowait(
            pb.ObserveResponse(
                opened=pb.WorkerOpened(
                    pair_id=pair.id,
                    worker_id=req.worker_id,
                    applied_sequence=applied,
                    acked_sequence=durable,
                    sketch_every=self._sketch_every(pair.id),
                )
            )
        )
        if first and pair.id in self._coefficients:  # refitted while it was opened
            self.out.put_nowait(pair.id)

    def _applied(self, pair: Pair, worker: str, seq: int, done: asyncio.Future[bool]) -> None:
        """A message's owner is done with it: a duplicate is acknowledged again."""
        if done.cancelled():
            return
        exc = done.exception()
        if exc is not None:
            # A fault of the service, not of the message: end the stream saying so;
            # its client resends every unacknowledged message on its next stream.
            log.error("applying a message of pair %s failed", pair.id, exc_info=exc)
            if self.error is None:
                self.error = Refused(
                    grpc.StatusCode.INTERNAL,
                    "avest failed applying a step (see its log); unacknowledged steps are "
                    "not applied: resend them",
                )
                self.out.put_nowait(None)
            return
        if done.result():
            return
        if self.service.app.registry.pairs.get(pair.id) is pair:
            self._duplicate(pair, worker, seq)

    def _duplicate(self, pair: Pair, worker: str, seq: int) -> None:
        """A step at or below what the pair applied of its worker: acknowledge it again
        once what covers it is durable, and say so when this stream never told the
        worker its watermark (a restarted sender reusing a worker id loses its steps)."""
        key = (pair.id, worker)
        level = pair.durable.get(worker, 0)
        applied = pair.applied.get(worker, 0)
        if seq <= applied and key not in self.opened and self.acked.get(key, 0) == 0:
            _stale.warning(
                "stale-sequence",
                "worker %s of pair %s sent sequence %d at or below the %d the pair already "
                "applied of it, on a stream that never acknowledged it: ignored as a "
                "duplicate. A resend after a lost acknowledgement, or a restarted sender "
                "reusing the worker id (its steps are lost: give each sender its own id, or "
                "a client that opens its worker)",
                limits.echo(worker),
                pair.id,
                seq,
                applied,
            )
        if level >= seq:
            self.acked[key] = level
            self.out.put_nowait(
                pb.ObserveResponse(
                    ack=pb.Ack(pair_id=pair.id, worker_id=worker, acked_sequence=level)
                )
            )

    def release(self) -> None:
        streaming = self.service.streaming
        for key in self.claimed:
            if self.service.owners.get(key) is self:
                del self.service.owners[key]
                streaming[key[0]] -= 1
                if streaming[key[0]] <= 0:
                    del streaming[key[0]]
        self.claimed.clear()

    async def _consume(self) -> None:
        service = self.service
        try:
            async for req in self.requests:
                if service.draining:
                    break
                if req is MALFORMED:
                    service.malformed("Observe")
                    self.error = Refused(*malformed_reply())
                    break
                if req.open:
                    try:
                        await self._open(req)
                    except Refused as r:
                        service.on_refused("Observe", r.reason)
                        self.error = Refused(
                            r.code, f"opening worker {limits.echo(req.worker_id)}: {r.message}"
                        )
                        break
                    continue
                try:
                    pair, batch, strata = service.validate_observe(req)
                    self._claim(pair.id, req.worker_id)
                except Refused as r:
                    service.on_refused("Observe", r.reason)
                    # The step's sequence, as text (what 0.1 clients read) and as data.
                    self.error = Refused(
                        r.code,
                        f"sequence {req.sequence} of worker {limits.echo(req.worker_id)}: "
                        f"{r.message}",
                        refusal.refused_sequence_metadata(req.sequence),
                    )
                    break
                key = (pair.id, req.worker_id)
                self.pairs.add(pair.id)
                self.acked.setdefault(key, 0)
                summary = req.summary if req.HasField("summary") else None
                # Waits while the pair's queue is full: this stream reads no more.
                done = await service.app.submit(
                    pair, req.worker_id, req.sequence, batch, summary, strata
                )
                done.add_done_callback(
                    functools.partial(self._applied, pair, req.worker_id, req.sequence)
                )
                self.last[pair.id] = done
        except Exception:
            # A fault of the service, not of the step: say so (the stream would
            # otherwise end as if the service had closed it), and the client
            # resends every unacknowledged step on its next stream.
            log.exception("an Observe stream failed")
            self.error = Refused(
                grpc.StatusCode.INTERNAL,
                "avest failed applying a step (see its log); unacknowledged steps are not "
                "applied: resend them",
            )
        finally:
            # Let the last applied steps become durable and be acknowledged
            # before the stream ends.
            # While draining, the server's final snapshot acknowledges what was
            # applied, then its drain closes this stream (within the grace period).
            if self.error is not None or not service.draining:
                if self.error is None:
                    await self._settle()
                    await service.app.flush()
                self.out.put_nowait(None)

    async def _settle(self) -> None:
        """Wait (a while) for this stream's last messages to be applied."""
        pending = [f for f in self.last.values() if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=SETTLE_S)

    async def run(self) -> AsyncIterator[pb.ObserveResponse]:
        service = self.service
        service.streams.add(self)
        service.open_streams += 1
        consumer = asyncio.create_task(self._consume())
        started = time.monotonic()
        try:
            while True:
                msg = await self.out.get()
                if msg is None:
                    break
                yield self._response(msg)
            if self.error is not None:
                await self.context.abort(self.error.code, self.error.message, self.error.metadata)
        finally:
            consumer.cancel()
            self.release()
            service.streams.discard(self)
            service.open_streams -= 1
            log.debug("observe stream closed after %.1fs", time.monotonic() - started)
