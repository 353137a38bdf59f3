"""One Observe call: apply steps as they arrive, push acknowledgements and updates."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from avest.grpc.refusals import Refused
from avest.state.app import Avest
from avest.state.pairs import Pair
from avest_wire.v1 import estimator_pb2 as pb

log = logging.getLogger("avest.grpc")


class StreamHost(Protocol):
    """What a stream needs from the service that opened it (the gRPC servicer)."""

    app: Avest
    streams: set[ObserveStream]
    open_streams: int
    draining: bool
    on_refused: Callable[[str, str], None]

    def validate_observe(self, req: pb.ObserveRequest) -> tuple[Pair, Any]: ...


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
        self.out: asyncio.Queue[pb.ObserveResponse | None] = asyncio.Queue()
        #: (pair_id, worker_id) -> highest sequence acknowledged on this stream.
        self.acked: dict[tuple[str, str], int] = {}
        self.pairs: set[str] = set()
        self.error: Refused | None = None

    def coefficients(self, pair_id: str, msg: pb.Coefficients) -> None:
        if pair_id in self.pairs:
            self.out.put_nowait(
                pb.ObserveResponse(coefficients_update=pb.CoefficientsUpdate(coefficients=msg))
            )

    def durable(self, pair_ids: set[str]) -> None:
        registry = self.service.app.registry
        for (pair_id, worker), sent in list(self.acked.items()):
            if pair_id not in pair_ids or pair_id not in registry.pairs:
                continue
            level = registry.pairs[pair_id].durable.get(worker, 0)
            if level > sent:
                self.acked[(pair_id, worker)] = level
                self.out.put_nowait(
                    pb.ObserveResponse(
                        ack=pb.Ack(pair_id=pair_id, worker_id=worker, acked_sequence=level)
                    )
                )

    def close(self) -> None:
        self.out.put_nowait(None)

    async def _consume(self) -> None:
        service = self.service
        try:
            async for req in self.requests:
                if service.draining:
                    break
                try:
                    pair, batch = service.validate_observe(req)
                except Refused as r:
                    service.on_refused("Observe", r.reason)
                    self.error = Refused(
                        r.code, f"sequence {req.sequence} of worker {req.worker_id!r}: {r.message}"
                    )
                    break
                key = (pair.id, req.worker_id)
                self.pairs.add(pair.id)
                self.acked.setdefault(key, 0)
                if not service.app.observe(pair, req.worker_id, req.sequence, batch):
                    # A duplicate: acknowledge again once what covers it is durable.
                    level = pair.durable.get(req.worker_id, 0)
                    if level >= req.sequence:
                        self.acked[key] = level
                        self.out.put_nowait(
                            pb.ObserveResponse(
                                ack=pb.Ack(
                                    pair_id=pair.id, worker_id=req.worker_id, acked_sequence=level
                                )
                            )
                        )
        finally:
            # Let the last applied steps become durable and be acknowledged
            # before the stream ends.
            # While draining, the server's final snapshot acknowledges what was
            # applied, then its drain closes this stream (within the grace period).
            if self.error is not None or not service.draining:
                if self.error is None:
                    await service.app.flush()
                self.out.put_nowait(None)

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
                yield msg
            if self.error is not None:
                await self.context.abort(self.error.code, self.error.message)
        finally:
            consumer.cancel()
            service.streams.discard(self)
            service.open_streams -= 1
            log.debug("observe stream closed after %.1fs", time.monotonic() - started)
