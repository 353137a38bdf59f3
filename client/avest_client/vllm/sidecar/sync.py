"""The sidecar sink's pair synchronisation: registration, warm start, cost curves.

Run by the sink's supervisor thread. :class:`Registrar` registers the pair
(with capped, jittered backoff while the sidecar is absent), keeps the
coefficients the sidecar answers with (the warm start, and those fetched
while the stream's view is stale) and chooses what the step serves.
:class:`CostSender` sends the cost curves vLLM profiled, again after each
registration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import grpc

from avest_client._stream import Backoff
from avest_client.client import EstimatorClient
from avest_client.errors import AvestError
from avest_client.forwarder import Forwarder
from avest_client.types import Registration, Served
from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.sidecar import logger
from avest_wire.limits import MAX_COST_POINTS
from avest_wire.pair import PairKey

#: How often coefficients are fetched directly while the stream's view is stale.
REPOLL_S = 1.0
#: Registration answers that retrying cannot change: the sink gives up (local refits).
FATAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
    }
)


def _plain(version: int, slope: float, intercepts: Iterable[float]) -> Served:
    return Served(float(slope), tuple(float(b) for b in intercepts), version=int(version))


class Registrar:
    """The pair's registration and the coefficients the sidecar answered with."""

    def __init__(
        self,
        config: ShimConfig,
        pair_key: PairKey,
        labels: dict[str, str],
        client: EstimatorClient,
        backoff: Backoff,
        stopping: threading.Event,
    ) -> None:
        self._config = config
        self._key = pair_key
        self._labels = labels
        self._client = client
        self._backoff = backoff
        self._stopping = stopping
        self.pair_id = ""
        self.rule = ""
        self.refit_interval = 0
        #: Successful registrations (the first, and one after each reconnect).
        self.registrations = 0
        #: A refusal that made the sink give up.
        self.error: AvestError | None = None
        #: Register at the next chance (at first, after a reconnect or NOT_FOUND).
        self.needed = True
        self._at = 0.0
        self._attempt = 0
        self._known: Served | None = None  # from RegisterPair / GetCoefficients
        self._stale_above: int | None = None  # the stream's view is stale up to this version
        self._repoll_at = 0.0

    def due(self, now: float) -> bool:
        return self.needed and now >= self._at

    def register(self, now: float, fwd: Forwarder | None) -> Registration | None:
        """One attempt; the registration, or None (retry later, or :attr:`error` set).

        ``fwd`` is the client forwarder (None before the first registration): a
        sidecar that answers with an older version than its stream pushed lost
        its state, and the stream's view is stale until it catches up.
        """
        key = self._key
        try:
            reg = self._client.register(key.target, key.draft, key.method, key.k, self._labels)
        except AvestError as exc:
            if self._stopping.is_set():
                return None
            if exc.code in FATAL_CODES:
                self.error = exc
                logger.error("avest: the sidecar refused the pair; local refits only: %s", exc)
                return None
            delay = self._backoff.delay(self._attempt)
            if self._attempt == 0:
                logger.warning(
                    "avest: cannot register with the sidecar at %s (%s); retrying, "
                    "local refits meanwhile",
                    self._config.address,
                    exc,
                )
            self._attempt += 1
            self._at = now + delay
            return None
        if self._config.mode == "summary" and not reg.accepts_round_summaries:
            # An older sidecar (0.1.0) would take a summary for an empty step:
            # send it nothing, and let vLLM's own estimator refit locally.
            self.error = AvestError(
                "the sidecar does not pool round summaries (an older release); "
                "set AVEST_MODE=raw to forward raw steps to it",
                grpc.StatusCode.FAILED_PRECONDITION,
                "RegisterPair",
            )
            self.needed = False
            logger.warning(
                "avest: the sidecar at %s does not pool round summaries (an older "
                "release); local refits only (AVEST_MODE=raw forwards raw steps to it)",
                self._config.address,
            )
            return None
        c = reg.coefficients
        known = _plain(c.version, c.slope, c.intercepts)
        if self.pair_id and reg.pair_id != self.pair_id:
            logger.warning("avest: pair id changed %s -> %s", self.pair_id, reg.pair_id)
        self.rule, self.refit_interval = reg.rule, reg.refit_interval
        self._attempt = 0
        self.needed = False
        self._known = known
        self.registrations += 1
        if fwd is None:
            self.pair_id = reg.pair_id
            return reg
        live = fwd.latest_coefficients()
        if live is not None and known.version < live.version:
            # A sidecar that lost its state counts from the start again.
            logger.warning(
                "avest: the sidecar's coefficients went back from version %d to %d",
                live.version,
                known.version,
            )
            self._stale_above = live.version
            self._repoll_at = time.monotonic() + REPOLL_S
        return reg

    def repoll(self, now: float) -> None:
        """While the stream's view is stale, fetch the coefficients once every REPOLL_S."""
        if self._stale_above is None or now < self._repoll_at:
            return
        self._repoll_at = now + REPOLL_S
        try:
            c = self._client.coefficients(self.pair_id)
        except AvestError:
            return
        self._known = _plain(c.version, c.slope, c.intercepts)

    def serve(self, live: Served | None) -> Served | None:
        """What the step serves: the stream's coefficients (``live``) unless stale,
        or the registration's (or repoll's) when newer."""
        if self._stale_above is not None:
            if live is not None and live.version > self._stale_above:
                self._stale_above = None  # the stream's view caught up
            else:
                live = None
        known = self._known
        return (
            known if live is None or (known is not None and known.version > live.version) else live
        )


class CostSender:
    """Sends the profiled cost curves (:data:`.costs.RECORDER`) once known, and after
    each registration (a restarted sidecar has none)."""

    def __init__(
        self,
        recorder: costs.CostCurveRecorder,
        client: EstimatorClient,
        hardware: str,
        backoff: Backoff,
    ) -> None:
        self.recorder = recorder
        self._client = client
        self._hardware = hardware
        self._backoff = backoff
        #: Cost-curve sets the sidecar took.
        self.sent = 0
        self._sent_version = 0
        self._due = False
        self._at = 0.0
        self._attempt = 0

    def again(self) -> None:
        """Send the curves at the next chance even if this version went already."""
        self._due = True
        self._attempt = 0
        self._at = 0.0

    def send(self, now: float, pair_id: str) -> None:
        snap = self.recorder.snapshot()
        if snap is None or now < self._at:
            return
        version, draft, verify, limit = snap
        if version == self._sent_version and not self._due:
            return
        # vLLM may profile more sizes than the service takes: send at most its limit
        draft, verify = (costs.thin(c, MAX_COST_POINTS, limit) for c in (draft, verify))
        try:
            self._client.set_cost_curves(
                pair_id, draft, verify, cudagraph_limit=limit, hardware=self._hardware
            )
        except AvestError as exc:
            if exc.code in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNAUTHENTICATED,
            ):
                # Cost curves are an admin action: a worker token is refused.
                logger.error("avest: the sidecar refused the cost curves: %s", exc)
                self._sent_version, self._due = version, False
                return
            self._at = now + self._backoff.delay(self._attempt)
            self._attempt += 1
            return
        self._sent_version, self._due = version, False
        self._attempt = 0
        self.sent += 1
        logger.info("avest: cost curves for %r sent to pair %s", self._hardware, pair_id)
