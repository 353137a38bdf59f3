"""The sidecar sink's supervisor: the background control loop of the ``avest-sink`` thread.

A mixin of :class:`avest_client.vllm.sidecar.sink.SidecarSink`. Every
``poll_s`` it follows the client forwarder (a reconnect or NOT_FOUND means
register again), runs the pair synchronisation (:mod:`.sidecar_sync`), and
refreshes the two values the step reads, ``connected`` (including hung-sidecar
detection) and the coefficients.
"""

from __future__ import annotations

import logging
import threading
import time

from avest_client import Stats
from avest_client.errors import AvestError
from avest_client.forwarder import Forwarder
from avest_client.vllm.sink import Coefficients

#: The sink's logger (the name it had before these methods left sidecar_sink).
logger = logging.getLogger("avest_client.vllm.sidecar_sink")

#: How often the supervisor looks at the forwarder, the cost curves and the clock.
POLL_S = 0.02


class Supervisor:
    """The ``avest-sink`` thread's loop; needs :class:`.sidecar_sync.PairSync` beside it."""

    error: AvestError | None
    pair_id: str
    registrations: int
    stalls: int
    _stop: threading.Event
    _poll_s: float
    _timeout: float
    _fwd: Forwarder | None
    _connected: bool
    _coef: Coefficients | None
    _known: Coefficients | None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick(time.monotonic())
            except Exception:  # noqa: BLE001 - keep supervising whatever happens
                if self._failures_logged < 5:
                    self._failures_logged += 1
                    logger.exception("avest: sink supervisor step failed")
            self._stop.wait(self._poll_s)

    def _tick(self, now: float) -> None:
        if self.error is not None:
            self._connected = False
            return
        fwd = self._fwd
        if fwd is not None:
            self._watch_forwarder(fwd, fwd.stats)
        if self._need_register and now >= self._register_at:
            self._try_register(now)
        if self.pair_id:
            self._maybe_send_costs(now)
            if self._stale_above is not None and now >= self._repoll_at:
                self._repoll(now)
        fwd = self._fwd
        if fwd is None:
            self._connected = False
        else:
            self._refresh(fwd, fwd.stats, time.monotonic())

    def _watch_forwarder(self, fwd: Forwarder, st: Stats) -> None:
        reconnects = st.reconnects
        if reconnects != self._reconnects_seen:
            # A new stream: the sidecar may have restarted. Register again
            # (idempotent) so a sidecar without our pair learns it, resend curves.
            self._reconnects_seen = reconnects
            self._need_register = True
        err = fwd.last_error
        if err != self._error_seen:
            self._error_seen = err
            if err.startswith("NOT_FOUND"):
                self._need_register = True

    def _refresh(self, fwd: Forwarder, st: Stats, now: float) -> None:
        streaming = fwd.connected
        if streaming:
            self._stream_seen = True
        opening = not self._stream_seen and now - self._registered_at < self._timeout
        # A stream that stays open while nothing it carries is acknowledged for
        # AVEST_TIMEOUT_S (a hung sidecar) is as good as lost: local refits resume.
        if not streaming or not self._was_streaming or st.pending == 0:
            self._progress_at = now
        if st.acked_sequence != self._acked_seen:
            self._acked_seen, self._progress_at = st.acked_sequence, now
        self._was_streaming = streaming
        stalled = streaming and now - self._progress_at > self._timeout
        if stalled != self._stalled:
            self._stalled = stalled
            if stalled:
                self.stalls += 1
                logger.warning(
                    "avest: the sidecar acknowledged nothing for %.1fs; local refits meanwhile",
                    now - self._progress_at,
                )
        live = fwd.latest_coefficients()
        if self._stale_above is not None:
            if live is not None and live[0] > self._stale_above:
                self._stale_above = None  # the stream's view caught up
            else:
                live = None
        known = self._known
        best = known if live is None or (known is not None and known[0] > live[0]) else live
        if best != self._coef:
            self._coef = best
        self._connected = (streaming or opening) and not stalled and self.registrations > 0
