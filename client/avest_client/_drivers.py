"""The forwarders' transports: one Observe stream each, over :class:`Session`.

* :class:`ThreadDriver` (sync :class:`~avest_client.forwarder.Forwarder`):
  the synchronous gRPC stack on a daemon thread. The sync stack, not
  ``grpc.aio``, because it keeps working in a process forked from one that
  already used gRPC (vLLM forks its workers); ``grpc.aio`` does not.
* :class:`AsyncDriver` (:class:`~avest_client.forwarder.AsyncForwarder`):
  ``grpc.aio`` as a task on the caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from avest_client._stream import ChannelOptions, Metadata, Session, reconnect_options
from avest_client.credentials import Credentials, aio_channel, sync_channel
from avest_client.ledger import Ledger
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

log = logging.getLogger("avest_client.forwarder")


class _Control:
    """Closing and deadline state shared by the drivers."""

    def __init__(self) -> None:
        self.closing = False
        self.cancelled = False
        self.deadline = float("inf")

    def close(self, timeout: float) -> None:
        self.deadline = min(self.deadline, time.monotonic() + max(0.0, timeout))
        self.closing = True

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def finished(self, ledger: Ledger) -> bool:
        return self.cancelled or (self.closing and (ledger.pending == 0 or self.remaining() <= 0))

    def bounded(self, delay: float) -> float:
        return min(delay, max(0.0, self.remaining())) if self.closing else delay


class _Driver:
    """What both transports hold: the session, channel options, timeouts, close state."""

    def __init__(
        self,
        address: str,
        session: Session,
        *,
        channel_options: ChannelOptions = (),
        connect_timeout: float = 5.0,
        rpc_timeout: float = 5.0,
        fetch_coefficients: bool = True,
        credentials: Credentials | None = None,
    ) -> None:
        self.address = address
        self.credentials = credentials
        self.session = session
        self.ledger = session.ledger
        self.channel_options = reconnect_options(session.backoff, channel_options)
        self.connect_timeout = connect_timeout
        self.rpc_timeout = rpc_timeout
        self.fetch_coefficients = fetch_coefficients
        self.control = _Control()

    def stopped(self) -> bool:
        """Closed and done, cancelled, or failed for good (no stream again)."""
        return self.control.finished(self.ledger) or self.session.failure is not None


class ThreadDriver(_Driver):
    """The sync-stack transport: call :meth:`run` on a thread of its own.

    The close deadline bounds reconnect attempts; a stream still open at the
    deadline is ended by :meth:`cancel` (the forwarder's ``close`` does it).
    """

    def __init__(self, address: str, session: Session, **options: Any) -> None:
        super().__init__(address, session, **options)
        self._cond = threading.Condition(threading.Lock())
        self._waiting = False
        self._wake = threading.Event()
        self._call: Any = None

    # -- control, from any thread ------------------------------------------------

    def notify(self) -> None:
        """New steps are queued: wake the request generator if it sleeps."""
        if self._waiting:
            with self._cond:
                self._cond.notify()

    def request_close(self, timeout: float) -> None:
        self.control.close(timeout)
        self._wake.set()
        with self._cond:
            self._cond.notify()

    def cancel(self) -> None:
        self.control.cancelled = True
        self._wake.set()
        call = self._call
        if call is not None:
            call.cancel()
        with self._cond:
            self._cond.notify()

    # -- the thread --------------------------------------------------------------

    def run(self) -> None:
        channel = sync_channel(self.address, self.channel_options, self.credentials)
        stub = pb_grpc.EstimatorServiceStub(channel)
        try:
            while not self.stopped():
                delay = self._one_stream(channel, stub)
                if self.stopped():
                    break
                if delay > 0:
                    self._wake.clear()
                    self._wake.wait(self.control.bounded(delay))
        finally:
            self.session.connected = False
            channel.close()

    def _one_stream(self, channel: grpc.Channel, stub: pb_grpc.EstimatorServiceStub) -> float:
        session, control = self.session, self.control
        # Probe with a unary call that waits for the connection (no
        # connectivity-polling thread, cancellable by close); it also brings
        # the coefficients pushed while we were away.
        connect = control.bounded(self.connect_timeout)
        self._wake.clear()
        probe = stub.GetCoefficients.future(
            pb.GetCoefficientsRequest(pair_id=session.pair_id),
            timeout=max(connect, 0.001),
            wait_for_ready=True,
        )
        probe.add_done_callback(lambda _: self._wake.set())
        self._wake.wait(connect + 1.0)
        if not probe.done():
            probe.cancel()
        if control.cancelled:
            return 0.0
        try:
            current = probe.result(timeout=0)
        except grpc.FutureCancelledError:
            return session.connect_failed(f"no connection to {self.address}")
        except grpc.RpcError as exc:
            if exc.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED,
            ):
                return session.connect_failed(f"no connection to {self.address}: {exc.code().name}")
            # Reachable (e.g. NOT_FOUND: the stream will say which steps fail).
        else:
            if self.fetch_coefficients:
                session.update(current.coefficients, current=True)
        alive = [True]
        session.stream_opened()
        call = stub.Observe(self._requests(alive))
        self._call = call
        code, details, trailing = grpc.StatusCode.OK, "", None
        try:
            for resp in call:
                session.on_response(resp)
                if resp.HasField("opened"):
                    self.notify()  # the steps may go out now
        except grpc.RpcError as exc:
            code, details, trailing = exc.code(), exc.details() or "", exc.trailing_metadata()
        except Exception as exc:  # transport oddities: a broken stream
            code, details = grpc.StatusCode.UNKNOWN, repr(exc)
        finally:
            alive[0] = False
            self._call = None
            with self._cond:
                self._cond.notify_all()
        return session.stream_ended(code, details, control.closing, trailing)

    def _requests(self, alive: list[bool]) -> Iterator[pb.ObserveRequest]:
        """The stream's request iterator (consumed by a gRPC thread)."""
        ledger, session, control, cond = self.ledger, self.session, self.control, self._cond
        if session.opening:
            yield session.open_message()
        while alive[0] and not control.cancelled:
            if session.failure is not None:
                return  # half-close: nothing more goes out
            if session.opening:
                with cond:  # the steps wait for the service's answer to the opening
                    self._waiting = True
                    if session.opening and alive[0] and not control.cancelled:
                        cond.wait(0.5)
                    self._waiting = False
                continue
            step = ledger.next_to_send()
            if step is None:
                if control.closing:
                    return  # half-close: the server flushes and acknowledges
                with cond:
                    # Announce the wait, then look again under the lock: a
                    # submit either is seen now or notifies after we wait.
                    self._waiting = True
                    if not ledger.has_unsent() and not control.closing and alive[0]:
                        cond.wait(0.5)
                    self._waiting = False
                continue
            yield session.message(step)


class AsyncDriver(_Driver):
    """The ``grpc.aio`` transport: await :meth:`run` as a task."""

    def __init__(self, address: str, session: Session, **options: Any) -> None:
        super().__init__(address, session, **options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._wakeup: asyncio.Event | None = None
        self._waiting = False
        self._task: asyncio.Task[None] | None = None

    # -- control, from any thread ------------------------------------------------

    def _in_loop(self, fn: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            fn()
        else:
            with contextlib.suppress(RuntimeError):  # loop closing
                loop.call_soon_threadsafe(fn)

    def notify(self) -> None:
        if self._waiting and self._wakeup is not None:
            self._in_loop(self._wakeup.set)

    def request_close(self, timeout: float) -> None:
        self.control.close(timeout)
        if self._wakeup is not None:
            self._in_loop(self._wakeup.set)

    def cancel(self) -> None:
        self.control.cancelled = True
        if self._task is not None:
            self._in_loop(self._task.cancel)

    # -- the task ----------------------------------------------------------------

    async def run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wakeup = asyncio.Event()
        self._task = asyncio.current_task()
        control = self.control
        channel = aio_channel(self.address, self.channel_options, self.credentials)
        stub = pb_grpc.EstimatorServiceStub(channel)
        try:
            while not self.stopped():
                delay = await self._one_stream(channel, stub)
                if self.stopped():
                    break
                if delay > 0:
                    self._wakeup.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._wakeup.wait(), control.bounded(delay))
        finally:
            self.session.connected = False
            with contextlib.suppress(Exception):
                await channel.close(grace=None)

    async def _one_stream(
        self, channel: grpc.aio.Channel, stub: pb_grpc.EstimatorServiceStub
    ) -> float:
        session, control = self.session, self.control
        connect = control.bounded(self.connect_timeout)
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout=connect)
        except asyncio.TimeoutError:
            return session.connect_failed(f"no connection to {self.address} within {connect:.1f}s")
        call = stub.Observe()
        session.stream_opened()
        fetch = asyncio.ensure_future(self._fetch(stub)) if self.fetch_coefficients else None
        reader = asyncio.ensure_future(self._read(call))
        writer = asyncio.ensure_future(self._write(call))
        try:
            while not reader.done():
                await asyncio.wait({reader}, timeout=0.1)
                if control.closing and control.remaining() <= 0:
                    call.cancel()
        finally:
            session.connected = False
            for task in (writer, fetch):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
            if not reader.done():  # we are being cancelled
                call.cancel()
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
        code, details, trailing = reader.result()
        return session.stream_ended(code, details, control.closing, trailing)

    async def _read(self, call: Any) -> tuple[grpc.StatusCode, str, Metadata]:
        """Read the stream to its end: its status code, message and trailing metadata."""
        session, wakeup = self.session, self._wakeup
        try:
            async for resp in call:
                session.on_response(resp)
                if resp.HasField("opened") and wakeup is not None:
                    wakeup.set()  # the steps may go out now
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or "", exc.trailing_metadata()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return grpc.StatusCode.UNKNOWN, repr(exc), None
        return await call.code(), (await call.details()) or "", await call.trailing_metadata()

    async def _write(self, call: Any) -> None:
        ledger, session, control = self.ledger, self.session, self.control
        wakeup = self._wakeup
        assert wakeup is not None
        try:
            if session.opening:
                await call.write(session.open_message())
            while True:
                if session.failure is not None:
                    await call.done_writing()  # nothing more goes out
                    return
                if session.opening:
                    # The steps wait for the service's answer to the opening.
                    self._waiting = True
                    wakeup.clear()
                    if session.opening:
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(wakeup.wait(), timeout=0.5)
                    self._waiting = False
                    continue
                step = ledger.next_to_send()
                if step is None:
                    if control.closing:
                        await call.done_writing()
                        return
                    self._waiting = True
                    if ledger.has_unsent() or control.closing:
                        self._waiting = False
                        continue
                    wakeup.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(wakeup.wait(), timeout=0.5)
                    self._waiting = False
                    continue
                await call.write(session.message(step))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call ended; the reader reports its status
            log.debug("observe write ended: %r", exc)

    async def _fetch(self, stub: pb_grpc.EstimatorServiceStub) -> None:
        try:
            resp = await stub.GetCoefficients(
                pb.GetCoefficientsRequest(pair_id=self.session.pair_id), timeout=self.rpc_timeout
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("GetCoefficients after connect failed: %s", exc.code())
            return
        self.session.update(resp.coefficients, current=True)
