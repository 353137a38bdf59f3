"""The sidecar sink's pair synchronisation: registration, cost curves, coefficient repolls.

A mixin of :class:`avest_client.vllm.sidecar.sink.SidecarSink`, run by its
supervisor thread (:mod:`.sidecar_supervisor`); the state it reads and writes
is set up by the sink's constructor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import grpc

from avest_client import Backoff, EstimatorClient
from avest_client.errors import AvestError
from avest_client.forwarder import Forwarder
from avest_wire.summary import RoundSummary
from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.pair import PairKey
from avest_client.vllm.sink import Coefficients

#: The sink's logger (the name it had before these methods left sidecar_sink).
logger = logging.getLogger("avest_client.vllm.sidecar_sink")

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


class PairSync:
    """Registers the pair, starts the client forwarder, sends cost curves, repolls."""

    config: ShimConfig
    pair_key: PairKey
    labels: dict[str, str]
    hardware: str
    pair_id: str
    rule: str
    refit_interval: int
    registrations: int
    cost_curves_sent: int
    error: AvestError | None
    _client: EstimatorClient
    _recorder: costs.CostCurveRecorder
    _backoff: Backoff
    _lock: threading.Lock
    _stop: threading.Event
    _buffer: deque[Any]
    _fwd: Forwarder | None
    _known: Coefficients | None

    def _try_register(self, now: float) -> None:
        key = self.pair_key
        try:
            reg = self._client.register(
                key.target, key.draft, key.method, key.num_speculative_tokens, self.labels
            )
        except AvestError as exc:
            if self._stop.is_set():
                return
            if exc.code in FATAL_CODES:
                self.error = exc
                self._connected = False
                logger.error("avest: the sidecar refused the pair; local refits only: %s", exc)
                return
            delay = self._backoff.delay(self._attempt)
            if self._attempt == 0:
                logger.warning(
                    "avest: cannot register with the sidecar at %s (%s); retrying, "
                    "local refits meanwhile",
                    self.config.address,
                    exc,
                )
            self._attempt += 1
            self._register_at = now + delay
            return
        if self.config.mode == "summary" and not reg.accepts_round_summaries:
            # An older sidecar (0.1.0) would take a summary for an empty step:
            # send it nothing, and let vLLM's own estimator refit locally.
            self.error = AvestError(
                "the sidecar does not pool round summaries (an older release); "
                "set AVEST_MODE=raw to forward raw steps to it",
                grpc.StatusCode.FAILED_PRECONDITION,
                "RegisterPair",
            )
            self._connected = False
            self._need_register = False
            logger.warning(
                "avest: the sidecar at %s does not pool round summaries (an older "
                "release); local refits only (AVEST_MODE=raw forwards raw steps to it)",
                self.config.address,
            )
            return
        c = reg.coefficients
        known: Coefficients = (int(c.version), float(c.slope), [float(b) for b in c.intercepts])
        if self.pair_id and reg.pair_id != self.pair_id:
            logger.warning("avest: pair id changed %s -> %s", self.pair_id, reg.pair_id)
        self.rule, self.refit_interval = reg.rule, reg.refit_interval
        self._attempt = 0
        self._need_register = False
        self._known = known
        self._costs_due = True
        self._costs_attempt = 0
        self._costs_at = 0.0
        self.registrations += 1
        fwd = self._fwd
        if fwd is None:
            # The stream opens in a moment: connected meanwhile (the warm start
            # applies at once), for at most AVEST_TIMEOUT_S.
            self._registered_at, self._stream_seen = time.monotonic(), False
            self.pair_id = reg.pair_id
            self._start_forwarder(reg.pair_id)
            logger.info(
                "avest: registered pair %s (%s, refit every %d); coefficients version %d",
                reg.pair_id,
                reg.rule,
                reg.refit_interval,
                known[0],
            )
        else:
            live = fwd.latest_coefficients()
            if live is not None and known[0] < live[0]:
                # A sidecar that lost its state counts from the start again.
                logger.warning(
                    "avest: the sidecar's coefficients went back from version %d to %d",
                    live[0],
                    known[0],
                )
                self._stale_above = live[0]
                self._repoll_at = time.monotonic() + REPOLL_S

    def _start_forwarder(self, pair_id: str) -> None:
        fwd = self._client.forwarder(
            pair_id,
            queue_size=self._capacity,
            k=self.pair_key.num_speculative_tokens,
            connect_timeout=self._timeout,
            backoff=self._backoff,
        )
        fwd.start()
        with self._lock:
            if not self._closed:
                # In order, before anything submitted after this point.
                while self._buffer:
                    item = self._buffer.popleft()
                    if isinstance(item, RoundSummary):
                        fwd.submit_summary(item)
                    else:
                        fwd.submit(*item)
                self._fwd = fwd
        if self._fwd is not fwd:  # closed meanwhile
            fwd.close(timeout=0.0)
            return
        self._reconnects_seen = fwd.stats.reconnects

    def _maybe_send_costs(self, now: float) -> None:
        snap = self._recorder.snapshot()
        if snap is None or now < self._costs_at:
            return
        version, draft, verify, limit = snap
        if version == self._costs_sent_version and not self._costs_due:
            return
        try:
            self._client.set_cost_curves(
                self.pair_id, draft, verify, cudagraph_limit=limit, hardware=self.hardware
            )
        except AvestError as exc:
            if exc.code in (
                grpc.StatusCode.INVALID_ARGUMENT,
                grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNAUTHENTICATED,
            ):
                # Cost curves are an admin action: a worker token is refused.
                logger.error("avest: the sidecar refused the cost curves: %s", exc)
                self._costs_sent_version, self._costs_due = version, False
                return
            self._costs_at = now + self._backoff.delay(self._costs_attempt)
            self._costs_attempt += 1
            return
        self._costs_sent_version, self._costs_due = version, False
        self._costs_attempt = 0
        self.cost_curves_sent += 1
        logger.info("avest: cost curves for %r sent to pair %s", self.hardware, self.pair_id)

    def _repoll(self, now: float) -> None:
        self._repoll_at = now + REPOLL_S
        try:
            c = self._client.coefficients(self.pair_id)
        except AvestError:
            return
        self._known = (int(c.version), float(c.slope), [float(b) for b in c.intercepts])
