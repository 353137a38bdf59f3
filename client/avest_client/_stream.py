"""The Observe stream protocol shared by the forwarders' drivers.

The protocol (what to send, what an acknowledgement releases, which step a
refusal names, how long to wait before reconnecting) lives in
:class:`Session` on top of the pure :class:`~avest_client.ledger.Ledger`;
it does no I/O. Two thin transports (:mod:`avest_client._drivers`) run it:

* :class:`ThreadDriver` (sync :class:`~avest_client.forwarder.Forwarder`):
  the synchronous gRPC stack on a daemon thread. The sync stack, not
  ``grpc.aio``, because it keeps working in a process forked from one that
  already used gRPC (vLLM forks its workers); ``grpc.aio`` does not.
* :class:`AsyncDriver` (:class:`~avest_client.forwarder.AsyncForwarder`):
  ``grpc.aio`` as a task on the caller's loop.

Each holds at most one Observe stream for one ``(pair_id, worker_id)``; on
any stream end it reconnects with capped, jittered exponential backoff and
the ledger's :meth:`~avest_client.ledger.Ledger.rewind` makes every
unacknowledged step go out again, in order, before new ones.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from avest_client.errors import WorkerIdReusedError
from avest_client.ledger import Ledger, Step
from avest_client.types import Served
from avest_wire.limits import MAX_K, MAX_LOG_ODDS
from avest_wire.messages import set_step_strata, summary_to_pb
from avest_wire.refusal import refused_sequence_from
from avest_wire.strata import MAX_STRATA, check_stratum
from avest_wire.summary import RoundSummary
from avest_wire.v1 import estimator_pb2 as pb

log = logging.getLogger("avest_client.forwarder")

#: Refusals of one step: the server names it as "sequence N of worker ..." (a
#: server before 0.2 in this text only; see :mod:`avest_wire.refusal`).
_REFUSED_STEP = re.compile(r"^sequence (\d+) of worker ")
#: Codes with which the server refuses a step; resending it would be refused again.
REFUSAL_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)

#: What a forwarder does when the service holds steps of an earlier sender of its
#: worker id at or above its first sequence (a restarted worker reusing its id):
#: ``continue`` renumbers its steps above them (they are new steps), ``resume``
#: takes them for its own steps sent before (a rerun replay: the service ignores
#: those again), ``fail`` stops with :class:`WorkerIdReusedError`.
REUSED_WORKER_ID = ("continue", "resume", "fail")

ChannelOptions = Sequence[tuple[str, Any]]
#: A status's trailing metadata as the gRPC stacks give it: ``(key, value)`` pairs.
Metadata = Iterable[tuple[str, str | bytes]] | None


@dataclass(frozen=True)
class StepData:
    """One validated decode step, copied out of the caller's buffers."""

    features: bytes
    rows: int
    k: int
    num_verified: npt.NDArray[np.uint32]
    num_accepted: npt.NDArray[np.uint32]
    exclude: npt.NDArray[np.bool_] | None
    #: Each row's stratum (docs/strata.md), or None: the pair's pooled traffic.
    strata: tuple[str, ...] | None = None


@dataclass(frozen=True)
class StratumSummary:
    """A round summary of one stratum's drafts (``RoundSummary.stratum`` on the wire)."""

    summary: RoundSummary
    stratum: str


def check_strata(strata: Sequence[str], rows: int) -> tuple[str, ...]:
    """A step's stratum per row: ``rows`` valid names, at most ``MAX_STRATA`` distinct
    (the checks the service makes); ValueError if not."""
    out = tuple(strata)
    if len(out) != rows:
        raise ValueError(f"strata must have {rows} entries, got {len(out)}")
    distinct = set(out)
    if len(distinct) > MAX_STRATA:
        raise ValueError(f"strata names {len(distinct)} strata, at most {MAX_STRATA}")
    for name in distinct:
        check_stratum(name)
    return out


def encode_step(
    features: npt.ArrayLike,
    num_verified: npt.ArrayLike,
    num_accepted: npt.ArrayLike,
    exclude: npt.ArrayLike | None,
    k: int | None = None,
    strata: Sequence[str] | None = None,
) -> StepData:
    """Validate and copy one step (the checks the service makes); ValueError if bad."""
    x = np.asarray(features)
    if x.ndim != 2:
        raise ValueError(f"features must be 2-D [R, K], got shape {x.shape}")
    rows, kk = x.shape
    if not 1 <= kk <= MAX_K:
        raise ValueError(f"features has K={kk}, must be in [1, {MAX_K}]")
    if k is not None and kk != k:
        raise ValueError(f"features has K={kk}, the pair has K={k}")
    if x.dtype.kind not in "fiu":
        raise ValueError(f"features must be numeric, got dtype {x.dtype}")
    x32 = np.ascontiguousarray(x, dtype="<f4")
    if x32.size:
        finite = np.isfinite(x32)
        if not finite.all():
            raise ValueError("features must be finite")
        if float(np.abs(x32).max()) > MAX_LOG_ODDS:
            raise ValueError(f"features must lie in [-{MAX_LOG_ODDS}, {MAX_LOG_ODDS}]")
    counts = []
    for name, v in (("num_verified", num_verified), ("num_accepted", num_accepted)):
        a = np.asarray(v)
        if a.shape != (rows,):
            raise ValueError(f"{name} must have shape [{rows}], got {list(a.shape)}")
        whole = a.dtype.kind in "iu" or (a.dtype.kind == "f" and np.all(a == np.round(a)))
        if a.size and not whole:
            raise ValueError(f"{name} must hold whole numbers")
        counts.append(a)
    d = counts[0].astype(np.int64)
    a = counts[1].astype(np.int64)
    if d.size and (d.min() < 0 or d.max() > kk):
        raise ValueError(f"num_verified must lie in [0, K={kk}]")
    if a.size and (a.min() < 0 or np.any(a > d)):
        raise ValueError("num_accepted must lie in [0, num_verified]")
    ex = None
    if exclude is not None:
        e = np.asarray(exclude)
        if e.shape != (rows,):
            raise ValueError(f"exclude must have shape [{rows}], got {list(e.shape)}")
        ex = e.astype(bool)
    return StepData(
        features=x32.tobytes(),
        rows=int(rows),
        k=int(kk),
        num_verified=d.astype(np.uint32),
        num_accepted=a.astype(np.uint32),
        exclude=ex,
        strata=check_strata(strata, rows) if strata is not None else None,
    )


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: ``min(max_s, initial_s * multiplier**n)``, jittered to [50 %, 100 %]."""

    initial_s: float = 0.05
    max_s: float = 5.0
    multiplier: float = 2.0

    def delay(self, attempt: int) -> float:
        d = min(self.max_s, self.initial_s * self.multiplier ** min(attempt, 64))
        return d * random.uniform(0.5, 1.0)


def refused_sequence(details: str | None, trailing: Metadata = None) -> int | None:
    """The sequence number a refusal names, if any: the status's structured
    entry, else (a server that sends none) the number its message starts with."""
    seq = refused_sequence_from(trailing)
    if seq is not None:
        return seq
    m = _REFUSED_STEP.match(details or "")
    return int(m.group(1)) if m else None


#: Every channel gets subchannels (connections) of its own. gRPC otherwise
#: shares them process-wide between channels to the same target, so a
#: channel created after fork would reuse the parent's connection ("Wrong
#: file descriptor generation").
PRIVATE_SUBCHANNELS: tuple[str, Any] = ("grpc.use_local_subchannel_pool", 1)


def channel_options(extra: ChannelOptions = ()) -> list[tuple[str, Any]]:
    """The options of every channel the client opens (``extra`` wins)."""
    names = {name for name, _ in extra}
    base = [PRIVATE_SUBCHANNELS] if PRIVATE_SUBCHANNELS[0] not in names else []
    return [*base, *extra]


def reconnect_options(backoff: Backoff, extra: ChannelOptions = ()) -> list[tuple[str, Any]]:
    """Channel options keeping gRPC's own reconnect backoff in line with ours."""
    ms = max(1, int(backoff.initial_s * 1000))
    return [
        PRIVATE_SUBCHANNELS,
        ("grpc.initial_reconnect_backoff_ms", ms),
        ("grpc.min_reconnect_backoff_ms", ms),
        ("grpc.max_reconnect_backoff_ms", max(ms, int(backoff.max_s * 1000))),
        *extra,
    ]


class Session:
    """The Observe protocol of one ``(pair_id, worker_id)``, without I/O.

    Thread-safe where it matters: the ledger has its own lock and
    :attr:`latest` is replaced atomically.
    """

    def __init__(
        self,
        pair_id: str,
        worker_id: str,
        ledger: Ledger,
        backoff: Backoff,
        reused_worker_id: str = "continue",
    ) -> None:
        if reused_worker_id not in REUSED_WORKER_ID:
            raise ValueError(
                f"reused_worker_id must be one of {', '.join(REUSED_WORKER_ID)}, "
                f"got {reused_worker_id!r}"
            )
        self.pair_id = pair_id
        self.worker_id = worker_id
        self.ledger = ledger
        self.backoff = backoff
        self.reused_worker_id = reused_worker_id
        #: Whether each stream opens the worker first (``ObserveRequest.open``):
        #: False once the service turned out not to know it (release 0.1.0).
        self.opens = True
        #: The current stream's opening request is unanswered: no step goes out.
        self.opening = False
        #: Why the forwarder stopped for good (``reused_worker_id="fail"``), or None.
        self.failure: WorkerIdReusedError | None = None
        #: ``(version, slope, intercepts)`` last received, or None.
        self.latest: Served | None = None
        #: ``(knots, logits, served)`` of the calibration layer pushed with them, or None.
        self.calibration: tuple[tuple[float, ...], tuple[float, ...], bool] | None = None
        #: Each stratum's coefficients pushed with :attr:`latest` (none from a service
        #: without strata, or for a pair without them).
        self.strata: dict[str, Served] = {}
        #: How the last stream (or connection attempt) failed, for diagnostics.
        self.last_error = ""
        self.connected = False
        #: Streams refused because another stream sends as this worker id.
        self.collisions = 0
        #: The service asks for a round summary's sketch with one round in this many
        #: (``WorkerOpened.sketch_every``; 1 from a service that does not ask).
        self.sketch_every = 1
        #: Round summaries sent, per stratum (None: the whole round), and where this
        #: worker's sketched rounds fall among them (spread over a pair's workers).
        self._rounds: collections.Counter[str | None] = collections.Counter()
        self._phase = random.randrange(1 << 30)
        self._attempt = 0
        self._streams = 0

    def next_delay(self) -> float:
        d = self.backoff.delay(self._attempt)
        self._attempt += 1
        return d

    def connect_failed(self, why: str) -> float:
        self.last_error = why
        return self.next_delay()

    def stream_opened(self) -> None:
        """A new stream: count it, and queue every unacknowledged step for resending."""
        if self._streams:
            self.ledger.count_reconnect()
        self._streams += 1
        self.ledger.rewind()
        self.connected = True
        self.opening = self.opens

    def open_message(self) -> pb.ObserveRequest:
        """The request that opens the worker on a new stream (before its steps)."""
        return pb.ObserveRequest(pair_id=self.pair_id, worker_id=self.worker_id, open=True)

    def on_response(self, resp: pb.ObserveResponse) -> None:
        event = resp.WhichOneof("event")
        if event == "ack":
            ack = resp.ack
            if ack.pair_id == self.pair_id and ack.worker_id == self.worker_id:
                self.ledger.ack(ack.acked_sequence)
                self._attempt = 0  # the stream works: reset the backoff
        elif event == "coefficients_update":
            update = resp.coefficients_update
            if not update.coefficients.pair_id or update.coefficients.pair_id == self.pair_id:
                self.sketch_every = max(1, update.sketch_every)
            self.update(update.coefficients)
        elif event == "opened":
            opened = resp.opened
            if opened.pair_id == self.pair_id and opened.worker_id == self.worker_id:
                self.sketch_every = max(1, opened.sketch_every)
                self.worker_opened(opened.applied_sequence, opened.acked_sequence)

    def worker_opened(self, applied: int, acked: int) -> None:
        """The service's answer to the opening request: it has applied this worker's
        steps up to ``applied`` and acknowledged them up to ``acked``.

        Before this forwarder ever sent a step, steps applied at or above its first
        sequence are an earlier sender's (a restarted worker reusing its id): it
        continues above them, takes them for its own, or fails, as configured.
        """
        self._attempt = 0  # the stream works: reset the backoff
        if self.ledger.never_sent() and self.reused_worker_id != "resume":
            if self.reused_worker_id == "fail":
                if applied >= self.ledger.first_held():
                    self.fail(applied)
                    return
            else:
                shift = self.ledger.continue_above(applied)
                if shift:
                    log.warning(
                        "avest: pair %s already applied sequence %d of worker %r from an "
                        "earlier sender with that worker id; this one continues above it "
                        "(its steps renumbered by +%d)",
                        self.pair_id,
                        applied,
                        self.worker_id,
                        shift,
                    )
        self.ledger.ack(acked)
        self.opening = False

    def fail(self, applied: int) -> None:
        """Stop for good: the service holds steps of an earlier sender of this worker id."""
        self.failure = WorkerIdReusedError(
            f"pair {self.pair_id} already applied sequence {applied} of worker "
            f"{self.worker_id!r} from an earlier sender with that worker id; its steps would "
            "be ignored as duplicates. Give each sender its own worker_id, or let the "
            'forwarder continue above them (reused_worker_id="continue")',
            method="Observe",
        )
        dropped = self.ledger.abandon()
        self.last_error = str(self.failure)
        self.opening = False
        log.error("avest: forwarder stopped, %d step(s) dropped: %s", dropped, self.failure)

    def update(self, c: pb.Coefficients, current: bool = False) -> None:
        """Keep pushed coefficients newer than the last; ``current`` (the server's
        answer on connecting) replaces whatever is held, since a sidecar restarted
        without its state counts versions from 0 again."""
        if c.pair_id and c.pair_id != self.pair_id:
            return
        latest = self.latest
        if current or latest is None or c.version > latest.version:
            self.latest = Served(
                float(c.slope), tuple(float(v) for v in c.intercepts), version=int(c.version)
            )
            self.calibration = (
                (tuple(c.calibration_knots), tuple(c.calibration_logits), c.calibration_served)
                if c.calibration_knots
                else None
            )
            self.strata = {
                s.stratum: Served(
                    float(s.slope), tuple(float(v) for v in s.intercepts), version=int(c.version)
                )
                for s in c.strata
            }

    def message(self, step: Step) -> pb.ObserveRequest:
        """The wire message of a step (built once, kept for resends)."""
        if step.message is None and isinstance(step.payload, (RoundSummary, StratumSummary)):
            own = step.payload if isinstance(step.payload, StratumSummary) else None
            summary = own.summary if own is not None else step.payload
            if not self._sketch_due(own.stratum if own is not None else None):
                summary = dataclasses.replace(summary, sketch=None)
            step.message = pb.ObserveRequest(
                pair_id=self.pair_id,
                worker_id=self.worker_id,
                sequence=step.sequence,
                k=summary.k,
                summary=summary_to_pb(summary),
            )
            if own is not None:
                step.message.summary.stratum = own.stratum
            step.payload = None
        if step.message is None:
            d: StepData = step.payload
            latest = self.latest
            step.message = pb.ObserveRequest(
                pair_id=self.pair_id,
                worker_id=self.worker_id,
                sequence=step.sequence,
                features=d.features,
                rows=d.rows,
                k=d.k,
                num_verified=d.num_verified.tolist(),
                num_accepted=d.num_accepted.tolist(),
                exclude=d.exclude.tolist() if d.exclude is not None else (),
                coefficients_version=latest.version if latest is not None else 0,
            )
            if d.strata is not None:
                set_step_strata(step.message, d.strata)
            step.payload = None
        return step.message

    def _sketch_due(self, stratum: str | None) -> bool:
        """Whether this round summary (of ``stratum``) goes with its sketch: one in
        :attr:`sketch_every` of each stratum's, decided when it is first sent."""
        sent = self._rounds[stratum]
        self._rounds[stratum] = sent + 1
        return (sent + self._phase) % self.sketch_every == 0

    def stream_ended(
        self, code: grpc.StatusCode, details: str, closing: bool, trailing: Metadata = None
    ) -> float:
        """Digest how a stream ended (its status and trailing metadata); returns the
        delay before the next one."""
        self.connected = False
        was_opening, self.opening = self.opening, False
        if code == grpc.StatusCode.OK:
            if closing:
                return 0.0
            # The server ended the stream (draining): it is going away.
            self.last_error = "stream closed by the server"
            return self.next_delay()
        self.last_error = f"{code.name}: {details}"
        if was_opening:
            seq = refused_sequence(details, trailing)
            if code == grpc.StatusCode.INVALID_ARGUMENT and seq == 0:
                # A service before the opening request took it for a step numbered 0.
                self.opens = False
                log.warning(
                    "avest: the service at hand does not tell a worker its watermark (an "
                    "older release): worker %r sends its steps without it. A restarted "
                    "sender reusing a worker id has its steps taken for duplicates there",
                    self.worker_id,
                )
                return 0.0
            if code in REFUSAL_CODES and seq in (0, None):
                # The opening stands for the first step: drop that, as its refusal would.
                if self.ledger.refuse(None):
                    log.warning("avest refused a step of %s: %s", self.worker_id, details)
                return self.next_delay()
        if code == grpc.StatusCode.ALREADY_EXISTS:
            # Another open stream sends as this worker id: nothing of ours was
            # applied. Say so loudly, keep the steps, try again later.
            self.collisions += 1
            log.error("avest: worker id collision for %r: %s", self.worker_id, details)
            return self.next_delay()
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            log.error("avest refused the stream of %s: %s", self.worker_id, details)
            return self.next_delay()
        if code in REFUSAL_CODES:
            # A refused step: drop it, never resend it. When the refusal names
            # no sequence the oldest held step goes, so progress is certain.
            seq = refused_sequence(details, trailing)
            if self.ledger.refuse(seq):
                log.warning("avest refused a step of %s: %s", self.worker_id, details)
            if code == grpc.StatusCode.INVALID_ARGUMENT and seq is not None:
                return 0.0  # a bad step, not a bad server: go on at once
            return self.next_delay()
        if not (closing and code == grpc.StatusCode.CANCELLED):
            log.info("avest observe stream ended (%s): %s", code.name, details)
        return self.next_delay()
