"""The synchronous client: :class:`EstimatorClient`."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from avest_client import codec
from avest_client._stream import ChannelOptions, channel_options
from avest_client.credentials import Credentials, sync_channel
from avest_client.errors import AvestError, InvalidArgumentError, from_rpc_error
from avest_client.forwarder import Forwarder
from avest_client.types import BudgetResult, Coefficients, PairInfo, Registration
from avest_client.watch import CoefficientsWatch, Watcher
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

log = logging.getLogger("avest_client")

DEFAULT_TIMEOUT = 5.0
_DEFAULT: Any = object()


class _Lazy:
    """A channel created on first use in the process that uses it (fork-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid = os.getpid()
        self.channel: Any = None
        self.stub: Any = None


class EstimatorClient:
    """Synchronous client of the avest estimator service.

    ``address`` is ``"host:port"``; ``timeout`` (seconds) is the deadline of
    every unary call unless the call passes its own. The channel is created on
    first use, in the process that uses it: after a fork the child opens its
    own. Errors are raised as :class:`~avest_client.errors.AvestError`
    subclasses.
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
        self._lazy = _Lazy()
        self._closed = False
        self._watchers: list[Watcher] = []
        self._forwarders: list[Forwarder] = []

    # -- channel ---------------------------------------------------------------

    def _stub(self) -> pb_grpc.EstimatorServiceStub:
        lazy = self._lazy
        if lazy.stub is not None and lazy.pid == os.getpid():
            return lazy.stub
        if self._closed:
            raise AvestError("the client is closed", grpc.StatusCode.CANCELLED)
        if lazy.pid != os.getpid():
            # Forked: the parent's channel (and maybe its lock) is unusable
            # here; leave them alone and start afresh in this process.
            self._lazy = lazy = _Lazy()
        with lazy.lock:
            if lazy.stub is None:
                self._open(lazy)
            return lazy.stub

    def _open(self, lazy: _Lazy) -> pb_grpc.EstimatorServiceStub:
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
            raise from_rpc_error(_Timeout(self.address), "wait_for_ready") from None

    def close(self) -> None:
        """Stop watchers, close the forwarders made here (flushing them), close the channel."""
        self._closed = True
        for w in self._watchers:
            w.cancel()
        self._watchers.clear()
        for fwd in self._forwarders:
            fwd.close()
        self._forwarders.clear()
        lazy = self._lazy
        with lazy.lock:
            if lazy.channel is not None and lazy.pid == os.getpid():
                lazy.channel.close()
            lazy.channel = lazy.stub = None

    def __enter__(self) -> EstimatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, timeout: Any) -> Any:
        fn = getattr(self._stub(), method)
        try:
            return fn(request, timeout=self.timeout if timeout is _DEFAULT else timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, method) from None

    # -- RPCs ------------------------------------------------------------------

    def register(
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
        """Register a model pair (idempotent: the same key gives the same id)."""
        with _local("RegisterPair"):
            req = codec.register_request(target, draft, method, k, labels, rule, refit_interval)
        return codec.registration(self._call("RegisterPair", req, timeout))

    def coefficients(self, pair_id: str, *, timeout: float | None = _DEFAULT) -> Coefficients:
        """The pair's current coefficients."""
        resp = self._call("GetCoefficients", pb.GetCoefficientsRequest(pair_id=pair_id), timeout)
        return codec.coefficients(resp.coefficients)

    def watch(
        self,
        pair_id: str,
        callback: Callable[[Coefficients], Any] | None = None,
        *,
        on_error: Callable[[AvestError], Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Follow a pair's coefficients.

        Without ``callback``: a :class:`CoefficientsWatch` iterator (first the
        current coefficients, then each new version; ``timeout`` bounds the
        whole stream, default none). With ``callback``: a :class:`Watcher`
        running on a daemon thread that reconnects on its own; cancel it with
        :meth:`Watcher.cancel` (``close()`` cancels it too).
        """
        if callback is not None:
            watcher = Watcher(self, pair_id, callback, on_error)
            self._watchers.append(watcher)
            return watcher
        call = self._stub().WatchCoefficients(
            pb.WatchCoefficientsRequest(pair_id=pair_id), timeout=timeout
        )
        return CoefficientsWatch(call)

    def score(
        self, pair_id: str, features: npt.ArrayLike, *, timeout: float | None = _DEFAULT
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """``(confidences, survival)``, float32 ``[R, K]``, at the current coefficients."""
        with _local("Score"):
            req = codec.score_request(pair_id, features)
        resp = self._call("Score", req, timeout)
        return (
            codec.matrix(resp.confidences, req.rows, req.k, "confidences"),
            codec.matrix(resp.survival, req.rows, req.k, "survival"),
        )

    def budget(
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
        """Choose the drafts to verify (``rule`` None: the service's lossless default).

        ``from_features``: ``confidences`` and ``stale_confidences`` hold features
        ``logit(q_max)``; the service scores them as :meth:`score` does (the
        pair's calibration layer while it is served) and budgets with those.
        """
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
        return codec.budget_result(self._call("Budget", req, timeout))

    def set_cost_curves(
        self,
        pair_id: str,
        draft_curve: Any,
        verify_curve: Any,
        cudagraph_limit: int = 0,
        hardware: str = "",
        *,
        timeout: float | None = _DEFAULT,
    ) -> None:
        """Store measured cost curves (``[(size, ms), ...]`` or ``{size: ms}``) for a hardware label."""
        with _local("SetCostCurves"):
            req = pb.SetCostCurvesRequest(
                pair_id=pair_id,
                hardware=hardware,
                draft_curve=codec.cost_points(draft_curve, "draft_curve"),
                verify_curve=codec.cost_points(verify_curve, "verify_curve"),
                cudagraph_capture_limit=int(cudagraph_limit),
            )
        self._call("SetCostCurves", req, timeout)

    def pairs(self, *, timeout: float | None = _DEFAULT) -> list[PairInfo]:
        """Every registered pair with its state, ordered by id."""
        resp = self._call("ListPairs", pb.ListPairsRequest(), timeout)
        return [codec.pair_info(p) for p in resp.pairs]

    def pair(self, pair_id: str, *, timeout: float | None = _DEFAULT) -> PairInfo:
        """One pair with its state."""
        return codec.pair_info(
            self._call("GetPair", pb.GetPairRequest(pair_id=pair_id), timeout).pair
        )

    def forwarder(
        self,
        pair_id: str,
        worker_id: str | None = None,
        queue_size: int = 1024,
        max_unacked: int | None = None,
        **kwargs: Any,
    ) -> Forwarder:
        """A background :class:`~avest_client.forwarder.Forwarder` for one worker's steps.

        It opens its own connection (on its own thread) when the first step
        is submitted. Extra keyword arguments: ``k`` (check every step's K),
        ``connect_timeout``, ``backoff`` (:class:`Backoff`),
        ``fetch_coefficients``, ``channel_options``.
        """
        kwargs.setdefault("channel_options", self.channel_options)
        kwargs.setdefault("rpc_timeout", self.timeout or DEFAULT_TIMEOUT)
        kwargs.setdefault("credentials", self.credentials)
        fwd = Forwarder(self.address, pair_id, worker_id, queue_size, max_unacked, **kwargs)
        self._forwarders.append(fwd)
        return fwd


class _Timeout(grpc.RpcError):
    def __init__(self, address: str) -> None:
        self._address = address

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return f"no connection to {self._address}"


class _local:
    """Turn a local validation error into :class:`InvalidArgumentError`."""

    def __init__(self, method: str) -> None:
        self.method = method

    def __enter__(self) -> None:
        return None

    def __exit__(self, tp: Any, exc: BaseException | None, tb: Any) -> None:
        if (
            exc is not None
            and isinstance(exc, (ValueError, TypeError))
            and not isinstance(exc, AvestError)
        ):
            raise InvalidArgumentError(str(exc), method=self.method) from exc
