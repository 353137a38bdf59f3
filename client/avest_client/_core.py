"""What both clients share, without I/O: each unary RPC as a request and a reader.

:class:`~avest_client.client.EstimatorClient` (the synchronous stack) and
:class:`~avest_client.aio.AsyncEstimatorClient` (``grpc.aio``) are thin
drivers over this module. A builder here checks the arguments and makes the
request (a local ``ValueError`` or ``TypeError`` becomes
:class:`~avest_client.errors.InvalidArgumentError`, the answer the service
would give) and says how to read the response; a driver only sends the
request, turns a failed call into an :class:`~avest_client.errors.AvestError`
and reads the response. :class:`ClientCore` holds what is not I/O in a
client: its address, credentials and deadline, and the watchers and
forwarders it made. The Observe stream's core is
:class:`avest_client._stream.Session`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Coroutine, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

import grpc
import numpy as np
import numpy.typing as npt

from avest_client import codec
from avest_client._stream import ChannelOptions
from avest_client.credentials import Credentials
from avest_client.errors import (
    AvestError,
    InvalidArgumentError,
    UnavailableError,
    from_rpc_error,
)
from avest_client.types import (
    BudgetResult,
    Coefficients,
    PairInfo,
    PairsPage,
    Registration,
    Schedule,
)
from avest_wire import limits
from avest_wire.v1 import estimator_pb2 as pb

if TYPE_CHECKING:
    from avest_client.forwarder import AsyncForwarder, Forwarder

P = ParamSpec("P")
T = TypeVar("T")
F = TypeVar("F")

#: Deadline (seconds) of a unary call when neither the client nor the call names one.
DEFAULT_TIMEOUT = 5.0
#: A call's ``timeout`` when the caller passes none: the client's own applies.
DEFAULT: Any = object()


@dataclass(frozen=True)
class Unary(Generic[T]):
    """One unary call, ready to send: the method, its request, how to read its answer.

    ``read`` takes the response, or its field ``field`` when one is named.
    """

    method: str
    request: Any
    read: Callable[[Any], T]
    timeout: float | None = DEFAULT
    field: str = ""

    def send(self, stub: Any, client_timeout: float | None) -> Any:
        """Start the call on ``stub`` (its answer, or an awaitable of it on ``grpc.aio``)."""
        timeout = client_timeout if self.timeout is DEFAULT else self.timeout
        return getattr(stub, self.method)(self.request, timeout=timeout)

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """Raise a failed call (``grpc.RpcError``, sync or aio) as its :class:`AvestError`."""
        try:
            yield
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.method) from None

    def answer(self, resp: Any) -> T:
        return self.read(getattr(resp, self.field) if self.field else resp)


class Rpc(Generic[P, T]):
    """A client method made of a call builder: ``client.name(...)`` builds the
    call with the builder's arguments and the client's ``_unary`` sends it (a
    coroutine on the asyncio client), so each RPC is written once for both."""

    def __init__(self, build: Callable[P, Unary[T]]) -> None:
        self.build = build
        self.__doc__ = build.__doc__
        self.__wrapped__ = build

    @overload
    def __get__(self, client: None, owner: type) -> Rpc[P, T]: ...
    @overload
    def __get__(self, client: ClientCore[Forwarder], owner: type) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, client: ClientCore[AsyncForwarder], owner: type
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: Any, owner: type) -> Any:
        if client is None:
            return self
        return functools.update_wrapper(functools.partial(client._unary, self.build), self.build)


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


# -- the unary RPCs (the clients' methods of the same names) -------------------


def register(
    target: str,
    draft: str,
    method: str,
    k: int,
    labels: Mapping[str, str] | None = None,
    rule: str = "",
    refit_interval: int = 0,
    *,
    timeout: float | None = DEFAULT,
) -> Unary[Registration]:
    """Register a model pair (idempotent: the same key gives the same id)."""
    with _local("RegisterPair"):
        req = codec.register_request(target, draft, method, k, labels, rule, refit_interval)
    return Unary("RegisterPair", req, codec.registration, timeout)


def coefficients(pair_id: str, *, timeout: float | None = DEFAULT) -> Unary[Coefficients]:
    """The pair's current coefficients."""
    req = pb.GetCoefficientsRequest(pair_id=pair_id)
    return Unary("GetCoefficients", req, codec.coefficients, timeout, "coefficients")


def score(
    pair_id: str, features: npt.ArrayLike, *, timeout: float | None = DEFAULT
) -> Unary[tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]]:
    """``(confidences, survival)``, float32 ``[R, K]``, at the current coefficients."""
    with _local("Score"):
        req = codec.score_request(pair_id, features)

    def read(resp: pb.ScoreResponse) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        return (
            codec.matrix(resp.confidences, req.rows, req.k, "confidences"),
            codec.matrix(resp.survival, req.rows, req.k, "survival"),
        )

    return Unary("Score", req, read, timeout)


def budget(
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
    timeout: float | None = DEFAULT,
) -> Unary[BudgetResult]:
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
    return Unary("Budget", req, codec.budget_result, timeout)


def set_cost_curves(
    pair_id: str,
    draft_curve: Any,
    verify_curve: Any,
    cudagraph_limit: int = 0,
    hardware: str = "",
    *,
    timeout: float | None = DEFAULT,
) -> Unary[None]:
    """Store measured cost curves (``[(size, ms), ...]`` or ``{size: ms}``) for a hardware label."""
    with _local("SetCostCurves"):
        req = pb.SetCostCurvesRequest(
            pair_id=pair_id,
            hardware=hardware,
            draft_curve=codec.cost_points(draft_curve, "draft_curve"),
            verify_curve=codec.cost_points(verify_curve, "verify_curve"),
            cudagraph_capture_limit=int(cudagraph_limit),
        )
    return Unary("SetCostCurves", req, lambda _: None, timeout)


def pairs_page(
    page_size: int = 0, page_token: str = "", *, timeout: float | None = DEFAULT
) -> Unary[PairsPage]:
    """One page of the registered pairs with their state, ordered by id: at most
    ``page_size`` (0: the service's default, which is also its cap) after the
    page that gave ``page_token`` ("" for the first page)."""
    with _local("ListPairs"):
        if page_size < 0:
            raise ValueError(f"page_size must be >= 0, got {page_size}")
        req = pb.ListPairsRequest(page_size=page_size, page_token=page_token)
    return Unary("ListPairs", req, _pairs_page, timeout)


def _pairs_page(resp: pb.ListPairsResponse) -> PairsPage:
    return PairsPage(tuple(codec.pair_info(p) for p in resp.pairs), resp.next_page_token)


def next_page(page: PairsPage, token: str) -> str:
    """The token to ask for after ``page`` (asked for with ``token``); "" when it was
    the last. A service that answers a token with that same token would never end."""
    if page.next_page_token and page.next_page_token == token:
        raise AvestError(
            "ListPairs answered a page with its own page token", grpc.StatusCode.INTERNAL
        )
    return page.next_page_token


def pair(pair_id: str, *, timeout: float | None = DEFAULT) -> Unary[PairInfo]:
    """One pair with its state."""
    return Unary("GetPair", pb.GetPairRequest(pair_id=pair_id), codec.pair_info, timeout, "pair")


def schedule(
    pair_id: str, hardware: str = "", *, timeout: float | None = DEFAULT
) -> Unary[Schedule]:
    """The pair's draft length by batch size on a hardware label ("" names the pair's
    only one): :meth:`Schedule.to_vllm` is vLLM's
    ``num_speculative_tokens_per_batch_size``. FAILED_PRECONDITION while the pair has
    too little evidence."""
    req = pb.GetScheduleRequest(pair_id=pair_id, hardware=hardware)
    return Unary("GetSchedule", req, codec.schedule, timeout)


# -- what a client holds besides its channel -----------------------------------


class ClientCore(Generic[F]):
    """The state and the non-I/O methods of both clients (``F``: its forwarder type).

    A driver subclass names its watch and forwarder types (:attr:`_Watch`,
    :attr:`_Watcher`, :attr:`_Forwarder`) and implements :meth:`_stub`.
    """

    _Watch: Callable[[Any], Any]
    _Watcher: Callable[..., Any]
    _Forwarder: Callable[..., F]

    def __init__(
        self,
        address: str,
        timeout: float | None = DEFAULT_TIMEOUT,
        channel_options: ChannelOptions = (),
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        credentials: Credentials | None = None,
        read_address: str | None = None,
    ) -> None:
        self.address = address
        #: Token and TLS: the arguments, else ``AVEST_TOKEN`` / ``AVEST_TLS_CA``.
        self.credentials = credentials or Credentials.resolve(token, tls_ca)
        self.timeout = timeout
        self.channel_options = tuple(channel_options)
        #: The service's read port (``avest serve --read-address``), if given:
        #: ``coefficients``, ``score`` and ``budget`` are sent there, on a channel of
        #: their own (a client of this class for that address), with the same
        #: credentials; every other call goes to ``address``. A read port of a service
        #: older than this client answers ``score`` and ``budget`` UNIMPLEMENTED.
        self.read_address = read_address if read_address and read_address != address else None
        self._reads: Any = (
            None
            if self.read_address is None
            else type(self)(
                self.read_address, timeout, self.channel_options, credentials=self.credentials
            )
        )
        self._closed = False
        self._watchers: list[Any] = []
        self._forwarders: list[F] = []
        self._forget_channel()

    def _forget_channel(self) -> None:
        """No channel yet: the next call opens one (in the process, and loop, that calls)."""
        raise NotImplementedError

    def _stub(self) -> Any:
        raise NotImplementedError

    def _stub_for(self, call: Unary[Any]) -> Any:
        """The stub that sends ``call``: the read port's for the methods it serves (when
        the client has a read address), this client's own otherwise."""
        if self._reads is not None and call.method in limits.READ_PORT_METHODS:
            if self._closed:
                raise self._closed_error()
            return self._reads._stub()
        return self._stub()

    def _unary(self, build: Callable[..., Unary[Any]], *args: Any, **kwargs: Any) -> Any:
        """Build the call with ``build(*args, **kwargs)``, send it, read the answer."""
        raise NotImplementedError

    # The unary RPCs: each a builder above, sent by the driver's ``_unary``.
    register = Rpc(register)
    coefficients = Rpc(coefficients)
    score = Rpc(score)
    budget = Rpc(budget)
    set_cost_curves = Rpc(set_cost_curves)
    pairs_page = Rpc(pairs_page)
    pair = Rpc(pair)
    schedule = Rpc(schedule)

    def _closed_error(self) -> AvestError:
        return AvestError("the client is closed", grpc.StatusCode.CANCELLED)

    def _not_ready(self) -> UnavailableError:
        return UnavailableError(f"no connection to {self.address}", method="wait_for_ready")

    def watch(
        self,
        pair_id: str,
        callback: Callable[[Coefficients], Any] | None = None,
        *,
        on_error: Callable[[AvestError], Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Follow a pair's coefficients.

        Without ``callback``: an iterator (async iterator, on the asyncio
        client) of coefficient versions, first the current ones, then each new
        version; ``timeout`` bounds the whole stream, default none. With
        ``callback`` (sync or, on the asyncio client, async): a watcher in the
        background (a daemon thread; an asyncio task) that reconnects on its
        own and gives up on NOT_FOUND / INVALID_ARGUMENT; cancel it with its
        ``cancel()`` (``close()`` cancels it too).
        """
        if callback is not None:
            watcher = self._Watcher(self, pair_id, callback, on_error)
            self._watchers.append(watcher)
            return watcher
        call = self._stub().WatchCoefficients(
            pb.WatchCoefficientsRequest(pair_id=pair_id), timeout=timeout
        )
        return self._Watch(call)

    def forwarder(
        self,
        pair_id: str,
        worker_id: str | None = None,
        queue_size: int = 1024,
        max_unacked: int | None = None,
        **kwargs: Any,
    ) -> F:
        """A background forwarder of one worker's steps (see :mod:`avest_client.forwarder`).

        It opens its own connection (a thread of its own for the sync client,
        a task on the running loop for the asyncio one) when the first step is
        submitted. Extra keyword arguments: ``k`` (check every step's K),
        ``connect_timeout``, ``backoff`` (:class:`Backoff`),
        ``fetch_coefficients``, ``channel_options``.
        """
        kwargs.setdefault("channel_options", self.channel_options)
        kwargs.setdefault("rpc_timeout", self.timeout or DEFAULT_TIMEOUT)
        kwargs.setdefault("credentials", self.credentials)
        fwd = self._Forwarder(self.address, pair_id, worker_id, queue_size, max_unacked, **kwargs)
        self._forwarders.append(fwd)
        return fwd
