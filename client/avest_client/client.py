"""The synchronous client: :class:`EstimatorClient`, a driver of :mod:`avest_client._core`."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from avest_client import _core
from avest_client._stream import channel_options
from avest_client.credentials import sync_channel
from avest_client.forwarder import Forwarder
from avest_client.types import PairInfo, PairsPage
from avest_client.watch import CoefficientsWatch, Watcher
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

log = logging.getLogger("avest_client")

T = TypeVar("T")


class _Lazy:
    """A channel created on first use in the process that uses it (fork-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.channel: Any = None
        self.stub: Any = None


class EstimatorClient(_core.ClientCore[Forwarder]):
    """Synchronous client of the avest estimator service.

    ``address`` is ``"host:port"``; ``read_address``, the service's read port, takes
    :meth:`coefficients`, :meth:`score` and :meth:`budget` when given (answered there
    while Observe streams keep ``address`` busy). ``timeout`` (seconds) is the deadline of
    every unary call unless the call passes its own. The channel is created on
    first use, in the process that uses it: after a fork the child opens its
    own. Errors are raised as :class:`~avest_client.errors.AvestError`
    subclasses. :meth:`watch` without a callback gives a
    :class:`CoefficientsWatch`, with one a :class:`Watcher`; :meth:`forwarder`
    gives a :class:`~avest_client.forwarder.Forwarder`.
    """

    _Watch = CoefficientsWatch
    _Watcher = Watcher
    _Forwarder = Forwarder

    # -- channel ---------------------------------------------------------------

    def _forget_channel(self) -> None:
        self._lazy = _Lazy()

    def _stub(self) -> pb_grpc.EstimatorServiceStub:
        lazy = self._lazy
        if lazy.stub is not None and lazy.pid == os.getpid():
            return lazy.stub
        if self._closed:
            raise self._closed_error()
        if lazy.pid != os.getpid():
            # Forked: the parent's channel (and maybe its lock) is unusable
            # here; leave them alone and start afresh in this process.
            self._lazy = lazy = _Lazy()
        with lazy.lock:
            if lazy.stub is None:
                lazy.channel = sync_channel(
                    self.address, channel_options(self.channel_options), self.credentials
                )
                lazy.stub = pb_grpc.EstimatorServiceStub(lazy.channel)
            return lazy.stub

    @property
    def channel(self) -> grpc.Channel:
        """The channel of this process (created if needed)."""
        self._stub()
        return self._lazy.channel

    def wait_for_ready(self, timeout: float | None = None) -> None:
        """Block until the channel is connected; UnavailableError after ``timeout``."""
        try:
            grpc.channel_ready_future(self.channel).result(
                timeout=self.timeout if timeout is None else timeout
            )
        except grpc.FutureTimeoutError:
            raise self._not_ready() from None

    def close(self) -> None:
        """Stop watchers, close the forwarders made here (flushing them), close the channel."""
        self._closed = True
        for w in self._watchers:
            w.cancel()
        self._watchers.clear()
        for fwd in self._forwarders:
            fwd.close()
        self._forwarders.clear()
        if self._reads is not None:
            self._reads.close()
        lazy = self._lazy
        with lazy.lock:
            if lazy.channel is not None and lazy.pid == os.getpid():
                lazy.channel.close()
            lazy.channel = lazy.stub = None

    def __enter__(self) -> EstimatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pair_pages(
        self, page_size: int = 0, *, timeout: float | None = _core.DEFAULT
    ) -> Iterator[PairsPage]:
        """The registered pairs a page at a time (``ListPairs``, ``page_size`` 0: the
        service's default), following each page's token to the last."""
        token = ""
        while True:
            page = self.pairs_page(page_size, token, timeout=timeout)
            yield page
            token = _core.next_page(page, token)
            if not token:
                return

    def pairs(self, *, timeout: float | None = _core.DEFAULT) -> list[PairInfo]:
        """Every registered pair with its state, ordered by id (all pages)."""
        return [p for page in self.pair_pages(timeout=timeout) for p in page.pairs]

    def _unary(self, build: Callable[..., _core.Unary[T]], *args: Any, **kwargs: Any) -> T:
        call = build(*args, **kwargs)
        with call.errors():
            resp = call.send(self._stub_for(call), self.timeout)
        return call.answer(resp)
