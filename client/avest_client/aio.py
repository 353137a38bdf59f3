"""The asyncio client: :class:`AsyncEstimatorClient` (``grpc.aio``)."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from avest_client import codec
from avest_client._stream import Backoff, ChannelOptions, channel_options
from avest_client.client import _DEFAULT, DEFAULT_TIMEOUT, _local
from avest_client.credentials import Credentials, aio_channel
from avest_client.errors import AvestError, UnavailableError, from_rpc_error
from avest_client.forwarder import AsyncForwarder
from avest_client.types import BudgetResult, Coefficients, PairInfo, Registration
from avest_client.watch import _FATAL_WATCH_CODES
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

log = logging.getLogger("avest_client")


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
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise StopAsyncIteration from None
            raise from_rpc_error(exc, "WatchCoefficients") from None
        except asyncio.CancelledError:
            if self._cancelled:  # our own cancel(), not the task's
                raise StopAsyncIteration from None
            raise
        return codec.coefficients(msg.coefficients)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


class AsyncWatcher:
    """A background watch task calling ``callback(coefficients)`` (sync or async) per new version.

    Reconnects with backoff; gives up on NOT_FOUND / INVALID_ARGUMENT.
    """

    def __init__(
        self,
        client: AsyncEstimatorClient,
        pair_id: str,
        callback: Callable[[Coefficients], Any],
        on_error: Callable[[AvestError], Any] | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self._client = client
        self._pair_id = pair_id
        self._callback = callback
        self._on_error = on_error
        self._backoff = backoff or Backoff(initial_s=0.1, max_s=5.0)
        #: Last version delivered (-1: none yet).
        self.version = -1
        self.error: AvestError | None = None
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"avest-watch-{pair_id}"
        )

    async def _run(self) -> None:
        attempt = 0
        while True:
            try:
                async for c in self._client.watch(self._pair_id):
                    attempt = 0
                    if c.version > self.version:
                        self.version = c.version
                        try:
                            result = self._callback(c)
                            if inspect.isawaitable(result):
                                await result
                        except Exception:
                            log.exception("avest watch callback failed")
            except AvestError as exc:
                if exc.code in _FATAL_WATCH_CODES:
                    self.error = exc
                    if self._on_error is not None:
                        self._on_error(exc)
                    return
            await asyncio.sleep(self._backoff.delay(attempt))
            attempt += 1

    async def cancel(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    close = cancel


class AsyncEstimatorClient:
    """asyncio client of the avest estimator service (same methods as the sync one, awaited).

    The ``grpc.aio`` channel is created on first use on the running loop, and
    again if the process (fork) or the loop changed.
    """

    def __init__(
        self,
        address: str,
        timeout: float | None = DEFAULT_TIMEOUT,
        channel_options: ChannelOptions = (),
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        self.address = address
        #: Token and TLS: the arguments, else ``AVEST_TOKEN`` / ``AVEST_TLS_CA``.
        self.credentials = credentials or Credentials.resolve(token, tls_ca)
        self.timeout = timeout
        self.channel_options = tuple(channel_options)
        self._pid = os.getpid()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub_: pb_grpc.EstimatorServiceStub | None = None
        self._closed = False
        self._watchers: list[AsyncWatcher] = []
        self._forwarders: list[AsyncForwarder] = []

    def _stub(self) -> pb_grpc.EstimatorServiceStub:
        loop = asyncio.get_running_loop()
        if self._stub_ is not None and self._pid == os.getpid() and self._loop is loop:
            return self._stub_
        if self._closed:
            raise AvestError("the client is closed", grpc.StatusCode.CANCELLED)
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
            raise UnavailableError(
                f"no connection to {self.address}", method="wait_for_ready"
            ) from None

    async def close(self) -> None:
        self._closed = True
        for w in self._watchers:
            await w.cancel()
        self._watchers.clear()
        for fwd in self._forwarders:
            await fwd.close()
        self._forwarders.clear()
        channel, self._channel, self._stub_ = self._channel, None, None
        if channel is not None and self._pid == os.getpid():
            with contextlib.suppress(Exception):
                await channel.close()

    async def __aenter__(self) -> AsyncEstimatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, request: Any, timeout: Any) -> Any:
        fn = getattr(self._stub(), method)
        try:
            return await fn(request, timeout=self.timeout if timeout is _DEFAULT else timeout)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, method) from None

    # -- RPCs ------------------------------------------------------------------

    async def register(
        self,
        target: str,
        draft: str,
        method: str,
        k: int,
        labels: Mapping[str, str] | None = None,
        rule: str = "",
        refit_interval: int = 0,
        *,
        timeout: float | None = _DEFAULT,
    ) -> Registration:
        with _local("RegisterPair"):
            req = codec.register_request(target, draft, method, k, labels, rule, refit_interval)
        return codec.registration(await self._call("RegisterPair", req, timeout))

    async def coefficients(self, pair_id: str, *, timeout: float | None = _DEFAULT) -> Coefficients:
        resp = await self._call(
            "GetCoefficients", pb.GetCoefficientsRequest(pair_id=pair_id), timeout
        )
        return codec.coefficients(resp.coefficients)

    def watch(
        self,
        pair_id: str,
        callback: Callable[[Coefficients], Any] | None = None,
        *,
        on_error: Callable[[AvestError], Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Without ``callback``: an async iterator of coefficient versions.

        With ``callback`` (sync or async): an :class:`AsyncWatcher` task that
        reconnects on its own; ``await watcher.cancel()`` stops it.
        """
        if callback is not None:
            watcher = AsyncWatcher(self, pair_id, callback, on_error)
            self._watchers.append(watcher)
            return watcher
        call = self._stub().WatchCoefficients(
            pb.WatchCoefficientsRequest(pair_id=pair_id), timeout=timeout
        )
        return AsyncCoefficientsWatch(call)

    async def score(
        self, pair_id: str, features: npt.ArrayLike, *, timeout: float | None = _DEFAULT
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        with _local("Score"):
            req = codec.score_request(pair_id, features)
        resp = await self._call("Score", req, timeout)
        return (
            codec.matrix(resp.confidences, req.rows, req.k, "confidences"),
            codec.matrix(resp.survival, req.rows, req.k, "survival"),
        )

    async def budget(
        self,
        pair_id: str,
        confidences: npt.ArrayLike,
        scheduled: npt.ArrayLike,
        num_non_draft_tokens: int,
        num_sampling: int,
        stale_confidences: npt.ArrayLike | None = None,
        hardware: str = "",
        rule: str | None = None,
        min_per_request: int = 0,
        *,
        from_features: bool = False,
        timeout: float | None = _DEFAULT,
    ) -> BudgetResult:
        with _local("Budget"):
            req = codec.budget_request(
                pair_id,
                confidences,
                scheduled,
                num_non_draft_tokens,
                num_sampling,
                stale_confidences,
                hardware,
                rule,
                min_per_request,
                from_features,
            )
        return codec.budget_result(await self._call("Budget", req, timeout))

    async def set_cost_curves(
        self,
        pair_id: str,
        draft_curve: Any,
        verify_curve: Any,
        cudagraph_limit: int = 0,
        hardware: str = "",
        *,
        timeout: float | None = _DEFAULT,
    ) -> None:
        with _local("SetCostCurves"):
            req = pb.SetCostCurvesRequest(
                pair_id=pair_id,
                hardware=hardware,
                draft_curve=codec.cost_points(draft_curve, "draft_curve"),
                verify_curve=codec.cost_points(verify_curve, "verify_curve"),
                cudagraph_capture_limit=int(cudagraph_limit),
            )
        await self._call("SetCostCurves", req, timeout)

    async def pairs(self, *, timeout: float | None = _DEFAULT) -> list[PairInfo]:
        resp = await self._call("ListPairs", pb.ListPairsRequest(), timeout)
        return [codec.pair_info(p) for p in resp.pairs]

    async def pair(self, pair_id: str, *, timeout: float | None = _DEFAULT) -> PairInfo:
        resp = await self._call("GetPair", pb.GetPairRequest(pair_id=pair_id), timeout)
        return codec.pair_info(resp.pair)

    def forwarder(
        self,
        pair_id: str,
        worker_id: str | None = None,
        queue_size: int = 1024,
        max_unacked: int | None = None,
        **kwargs: Any,
    ) -> AsyncForwarder:
        """An :class:`~avest_client.forwarder.AsyncForwarder` (a task on the running loop)."""
        kwargs.setdefault("channel_options", self.channel_options)
        kwargs.setdefault("rpc_timeout", self.timeout or DEFAULT_TIMEOUT)
        kwargs.setdefault("credentials", self.credentials)
        fwd = AsyncForwarder(self.address, pair_id, worker_id, queue_size, max_unacked, **kwargs)
        self._forwarders.append(fwd)
        return fwd
