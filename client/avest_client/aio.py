"""The asyncio client: :class:`AsyncEstimatorClient` (``grpc.aio``), a driver of
:mod:`avest_client._core`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc

from avest_client import _core, codec
from avest_client._stream import channel_options
from avest_client.credentials import aio_channel
from avest_client.errors import AvestError
from avest_client.forwarder import AsyncForwarder
from avest_client.types import Coefficients, PairInfo, PairsPage
from avest_client.watch import Follow, stream_error
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

log = logging.getLogger("avest_client")

T = TypeVar("T")


class AsyncCoefficientsWatch(AsyncIterator[Coefficients]):
    """Async iterator over a pair's coefficient versions (first the current ones)."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._it: Any = None
        self._cancelled = False

    def __aiter__(self) -> AsyncCoefficientsWatch:
        return self

    async def __anext__(self) -> Coefficients:
        if self._it is None:
            self._it = self._call.__aiter__()
        try:
            msg = await self._it.__anext__()
        except grpc.aio.AioRpcError as exc:
            raise stream_error(exc, StopAsyncIteration) from None
        except asyncio.CancelledError:
            if self._cancelled:  # our own cancel(), not the task's
                raise StopAsyncIteration from None
            raise
        return codec.coefficients(msg.coefficients)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


class AsyncWatcher(Follow):
    """A background watch task calling ``callback(coefficients)`` (sync or async) per new version.

    Reconnects with backoff; gives up on NOT_FOUND / INVALID_ARGUMENT.
    """

    def _start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"avest-watch-{self._pair_id}"
        )

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                async for c in self._client.watch(self._pair_id):
                    attempt = 0
                    if self._fresh(c):
                        try:
                            result = self._callback(c)
                            if inspect.isawaitable(result):
                                await result
                        except Exception:
                            log.exception("avest watch callback failed")
            except AvestError as exc:
                if self._gives_up(exc):
                    return
            await asyncio.sleep(self._backoff.delay(attempt))
            attempt += 1

    async def cancel(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    close = cancel


class AsyncEstimatorClient(_core.ClientCore[AsyncForwarder]):
    """asyncio client of the avest estimator service (same methods as the sync one, awaited).

    The ``grpc.aio`` channel is created on first use on the running loop, and
    again if the process (fork) or the loop changed. :meth:`watch` without a
    callback gives an :class:`AsyncCoefficientsWatch`, with one an
    :class:`AsyncWatcher`; :meth:`forwarder` gives an
    :class:`~avest_client.forwarder.AsyncForwarder` (a task on the running loop).
    """

    _Watch = AsyncCoefficientsWatch
    _Watcher = AsyncWatcher
    _Forwarder = AsyncForwarder

    def _forget_channel(self) -> None:
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.EstimatorServiceStub | None = None

    def _stub(self) -> pb_grpc.EstimatorServiceStub:
        loop = asyncio.get_running_loop()
        if self._stub_ is not None and self._pid == os.getpid() and self._loop is loop:
            return self._stub_
        if self._closed:
            raise self._closed_error()
        # First use, or a new process or loop: the old channel cannot serve here.
        self._pid = os.getpid()
        self._loop = loop
        self._channel = aio_channel(
            self.address, channel_options(self.channel_options), self.credentials
        )
        self._stub_ = pb_grpc.EstimatorServiceStub(self._channel)
        return self._stub_

    @property
    def channel(self) -> grpc.aio.Channel:
        self._stub()
        assert self._channel is not None
        return self._channel

    async def wait_for_ready(self, timeout: float | None = None) -> None:
        try:
            await asyncio.wait_for(
                self.channel.channel_ready(), timeout=self.timeout if timeout is None else timeout
            )
        except asyncio.TimeoutError:
            raise self._not_ready() from None

    async def close(self) -> None:
        self._closed = True
        for w in self._watchers:
            await w.cancel()
        self._watchers.clear()
        for fwd in self._forwarders:
            await fwd.close()
        self._forwarders.clear()
        if self._reads is not None:
            await self._reads.close()
        channel, self._channel, self._stub_ = self._channel, None, None
        if channel is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):
                await channel.close()

    async def __aenter__(self) -> AsyncEstimatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def pair_pages(
        self, page_size: int = 0, *, timeout: float | None = _core.DEFAULT
    ) -> AsyncIterator[PairsPage]:
        """The registered pairs a page at a time (``ListPairs``, ``page_size`` 0: the
        service's default), following each page's token to the last."""
        token = ""
        while True:
            page = await self.pairs_page(page_size, token, timeout=timeout)
            yield page
            token = _core.next_page(page, token)
            if not token:
                return

    async def pairs(self, *, timeout: float | None = _core.DEFAULT) -> list[PairInfo]:
        """Every registered pair with its state, ordered by id (all pages)."""
        return [p async for page in self.pair_pages(timeout=timeout) for p in page.pairs]

    async def _unary(self, build: Callable[..., _core.Unary[T]], *args: Any, **kwargs: Any) -> T:
        call = build(*args, **kwargs)
        with call.errors():
            resp = await call.send(self._stub_for(call), self.timeout)
        return call.answer(resp)
