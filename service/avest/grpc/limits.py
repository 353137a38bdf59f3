"""What the gRPC adapter reads of the process settings: its per-message and rate bounds."""

from __future__ import annotations

from dataclasses import dataclass

from avest_wire.limits import MAX_MESSAGE_BYTES

#: Workers of one pair whose every round summary carries its calibration sketch. A
#: round of B = 256 requests over 100 steps at K = 8 sketches tens of thousands of
#: drafts (4,500 histogram cells): 16 workers' rounds are far more than the pair's
#: calibration measures and layer need, and a pair with up to 16 workers streaming
#: keeps every sketch. Beyond, each worker sends one sketch in ceil(workers / 16)
#: rounds, so the sketches a pair checks and pools stop growing with the fleet: they
#: are most of the service's work per summary (bench/RESULTS.md, "Sketches that stop
#: growing with the fleet").
SKETCHED_WORKERS = 16

#: Coefficient pushes a second per pair, its Observe streams together. A pair refits at
#: most ten times a second (``--min-refit-interval-ms``), and each refit went to each of
#: its streams: 10,000 pushes a second at 1,000 workers, more of the service's work than
#: their summaries. Up to 100 workers streaming, each still gets every refit; beyond,
#: each gets the latest at most every ``workers / 1,000`` seconds (1 s at 1,000 workers,
#: half of a typical vLLM round), so a pair's pushes stop growing with the fleet
#: (bench/RESULTS.md, "Pushes that stop growing with the fleet").
PAIR_PUSHES_PER_S = 1000.0


@dataclass(frozen=True)
class StreamLimits:
    #: Largest number of requests (rows) in one Observe step.
    max_rows: int
    #: Unary calls per second naming one pair, all clients together, per port (0: no limit).
    pair_rate: float
    #: Largest gRPC message sent or received (``ListPairs`` pages fit it).
    max_message_bytes: int = MAX_MESSAGE_BYTES
    #: Seconds between two coefficient pushes of one pair on one Observe stream (the
    #: latest goes when the interval is over; 0: each refit's at once).
    push_every_s: float = 0.0
    #: Workers of a pair whose every round carries its sketch (0: every worker's).
    sketched_workers: int = SKETCHED_WORKERS
    #: Coefficient pushes a second per pair, its streams together (0: no bound).
    pair_pushes_per_s: float = PAIR_PUSHES_PER_S

    def push_every(self, streaming: int) -> float:
        """Seconds between two pushes of a pair on one stream, with ``streaming`` workers
        of the pair streaming: ``push_every_s``, or longer, so that the pair's streams
        together get at most ``pair_pushes_per_s``."""
        per = self.pair_pushes_per_s
        return max(self.push_every_s, streaming / per if per > 0 else 0.0)

    def sketch_every(self, streaming: int) -> int:
        """One round summary in how many carries its sketch, with ``streaming`` workers
        of its pair streaming (``WorkerOpened.sketch_every``)."""
        per = self.sketched_workers
        return 1 if per <= 0 or streaming <= per else -(-streaming // per)
