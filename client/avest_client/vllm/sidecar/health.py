"""Whether the sidecar's stream serves: up, opening, lost, or hung.

Read by the sink's supervisor every ``poll_s`` from the client forwarder's
state. A new stream (a reconnect: the sidecar may have restarted) or a
NOT_FOUND (it lost its state) means the pair must be registered again. The
stream counts as up while it is open and acknowledges what it carries; for
the first ``AVEST_TIMEOUT_S`` after registration it counts as opening; one
that stays open while nothing it carries is acknowledged for
``AVEST_TIMEOUT_S`` (a hung sidecar) is as good as lost, and local refits
resume.
"""

from __future__ import annotations

from avest_client.forwarder import Forwarder
from avest_client.ledger import Stats
from avest_client.vllm.sidecar import logger


class StreamHealth:
    """What the supervisor remembers of the forwarder's stream between looks."""

    def __init__(self, timeout: float) -> None:
        self._timeout = timeout
        #: Times the stream was found hung.
        self.stalls = 0
        self._registered_at = 0.0
        self._stream_seen = False
        self._reconnects_seen = 0
        self._error_seen = ""
        self._progress_at = 0.0
        self._acked_seen = 0
        self._was_streaming = False
        self._stalled = False

    def opening(self, now: float) -> None:
        """The pair is registered, its stream about to open: it counts as up meanwhile."""
        self._registered_at, self._stream_seen = now, False

    def attached(self, fwd: Forwarder) -> None:
        """The forwarder starts: reconnects are counted from its present count."""
        self._reconnects_seen = fwd.stats.reconnects

    def needs_register(self, fwd: Forwarder, st: Stats) -> bool:
        """Whether the stream reconnected or was told NOT_FOUND since the last look."""
        again = False
        reconnects = st.reconnects
        if reconnects != self._reconnects_seen:
            # A new stream: the sidecar may have restarted. Register again
            # (idempotent) so a sidecar without our pair learns it, resend curves.
            self._reconnects_seen = reconnects
            again = True
        err = fwd.last_error
        if err != self._error_seen:
            self._error_seen = err
            if err.startswith("NOT_FOUND"):
                again = True
        return again

    def serves(self, fwd: Forwarder, st: Stats, now: float) -> bool:
        """Whether the stream is up or opening, and not hung."""
        streaming = fwd.connected
        if streaming:
            self._stream_seen = True
        opening = not self._stream_seen and now - self._registered_at < self._timeout
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
        return (streaming or opening) and not stalled
