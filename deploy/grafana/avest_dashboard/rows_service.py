"""Rows about the service: Ingestion and refits, RPC."""

from __future__ import annotations

from avest.metrics import names as m

from .panels import HIDE_WHEN_ZERO, Layout, dashed, refs, row, target, timeseries
from .queries import RI, SIDECAR, pair, sidecar

NOT_OK = 'code!="OK"'
REFIT_BUCKET = f"sum by (le) (rate({sidecar(m.REFIT_DURATION + '_bucket')}[{RI}]))"
#: Unary calls only: a stream's duration is its lifetime, not a latency.
UNARY = f'{SIDECAR},method!~"Observe|WatchCoefficients"'
RPC_BUCKET = f"sum by (le, method) (rate({m.RPC_DURATION}_bucket{{{UNARY}}}[{RI}]))"
#: Each replica's own loop: its worst quantile is what matters.
LAG_BUCKET = f"sum by (le, instance) (rate({sidecar(m.LOOP_LAG + '_bucket')}[{RI}]))"
WRITE_BUCKET = f"sum by (le, instance) (rate({sidecar(m.STORE_WRITE_DURATION + '_bucket')}[{RI}]))"
#: Refit outcomes and the colour each is drawn in.
OUTCOME_COLORS = (("applied", "green"), ("slope_held", "orange"), ("rejected", "red"))


def sparse(
    lay: Layout,
    title: str,
    description: str,
    expr: str,
    legend: str,
    unit: str = "reqps",
    overrides: tuple[dict, ...] = (),
) -> dict:
    """One query of many rarely non-zero series; those at zero all along are hidden."""
    return timeseries(
        lay,
        title,
        description + " Series at zero all along are hidden.",
        [target(expr, legend)],
        unit=unit,
        overrides=[HIDE_WHEN_ZERO, *overrides],
    )


def fixed_color(name: str, color: str) -> dict:
    return {
        "matcher": {"id": "byName", "options": name},
        "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": color}}],
    }


def ingestion(lay: Layout) -> list[dict]:
    """The "Ingestion and refits" row and its panels."""
    return [
        row(lay, "Ingestion and refits"),
        timeseries(
            lay,
            "Drafts and steps ingested per second",
            "Verified drafts (labelled positions) and Observe steps applied per second for "
            "the pair, pooled over workers. Zero while vLLM serves traffic means the shim "
            "is not forwarding (alert AvestPairNoObservations).",
            refs(
                (f"sum(rate({pair(m.DRAFTS_OBSERVED)}[{RI}]))", "drafts/s"),
                (f"sum(rate({pair(m.STEPS_OBSERVED)}[{RI}]))", "steps/s"),
            ),
            unit="ops",
        ),
        sparse(
            lay,
            "Refits by outcome",
            "Refits per rate window by outcome: applied; slope_held (the slope step was "
            "dropped: negative or NaN); rejected (non-finite solve, nothing changed). "
            "Alerts: AvestRefitsFailing, AvestRefitsRejected.",
            f"sum by (outcome) (increase({pair(m.REFITS)}[{RI}]))",
            "{{outcome}}",
            unit="short",
            overrides=tuple(fixed_color(name, color) for name, color in OUTCOME_COLORS),
        ),
        timeseries(
            lay,
            "Refit latency",
            "Seconds to apply the step that closes a round and refit (all pairs), "
            "quantiles from avest_refit_duration_seconds.",
            refs(
                (f"histogram_quantile(0.5, {REFIT_BUCKET})", "p50"),
                (f"histogram_quantile(0.9, {REFIT_BUCKET})", "p90"),
                (f"histogram_quantile(0.99, {REFIT_BUCKET})", "p99"),
            ),
            unit="s",
        ),
        timeseries(
            lay,
            "Event loop lag",
            "How late each service process's event loop ran its heartbeat (due every "
            "0.5 s), p50 and p99 of the worst process: every Observe message, unary call "
            "and admin request waits on the loop at least this long. Hundreds of "
            "milliseconds mean a saturated loop; /healthz answers 503 (and liveness "
            "restarts the process) once it has not run for 10 s.",
            refs(
                (f"max(histogram_quantile(0.99, {LAG_BUCKET}))", "p99"),
                (f"max(histogram_quantile(0.5, {LAG_BUCKET}))", "p50"),
            ),
            unit="s",
        ),
        timeseries(
            lay,
            "Group commit",
            "How long each service process's group commit takes, from the snapshot of "
            "the changed pairs to their acknowledgements (a replica: its append to the "
            "pending log), p50 and p99 of the worst process. A worker's ack waits for "
            "--flush-interval-ms, then for this: a slow store shows here first.",
            refs(
                (f"max(histogram_quantile(0.99, {WRITE_BUCKET}))", "p99"),
                (f"max(histogram_quantile(0.5, {WRITE_BUCKET}))", "p50"),
            ),
            unit="s",
        ),
        timeseries(
            lay,
            "Durability backlog and streams",
            "Observe steps applied but not yet durable (hence not yet acknowledged), and "
            "open streams, summed over the replicas (each counts its own). A growing backlog "
            "means group commits lag: workers hold more unacknowledged steps and may drop "
            "the oldest (alert AvestObserveBacklog).",
            refs(
                (f"sum({sidecar(m.QUEUE_DEPTH)})", "steps not yet durable"),
                (f"sum({sidecar(m.OPEN_STREAMS)})", "open streams"),
            ),
        ),
        timeseries(
            lay,
            "Backpressure",
            "Observe messages checked and waiting in the pairs' queues (summed over the "
            "replicas), messages per second that found their pair's queue full and waited "
            "(their stream read no further until there was room; nothing refused or lost), "
            "and whether streams wait for room now (1 on some replica). Brief waits in bursts "
            "are normal; waiting that lasts means overload (alert AvestOverloaded).",
            refs(
                (f"sum({sidecar(m.ADMISSION_QUEUED)})", "queued messages"),
                (f"sum(rate({sidecar(m.BACKPRESSURE_WAITS)}[{RI}]))", "waits/s"),
                (f"max({sidecar(m.OVERLOADED)})", "overloaded"),
            ),
        ),
    ]


def rpc(lay: Layout) -> list[dict]:
    """The "RPC" row and its panels."""
    return [
        row(lay, "RPC"),
        timeseries(
            lay,
            "Unary RPC latency by method",
            "p50 (dashed) and p99 of unary calls (RegisterPair, Score, Budget, ...) by "
            "method. Streams are left out: their duration is the stream's lifetime.",
            refs(
                (f"histogram_quantile(0.99, {RPC_BUCKET})", "{{method}} p99"),
                (f"histogram_quantile(0.5, {RPC_BUCKET})", "{{method}} p50"),
            ),
            unit="s",
            overrides=[dashed(".* p50")],
        ),
        sparse(
            lay,
            "Calls completed by method and code",
            "Calls (streams: when they end) completed per second, by method and gRPC status.",
            f"sum by (method, code) (rate({sidecar(m.RPC_DURATION + '_count')}[{RI}]))",
            "{{method}} {{code}}",
        ),
        sparse(
            lay,
            "Refused batches by method and reason",
            "Requests refused with the state untouched (invalid features or counts, wrong K, "
            "unknown pair, limits), per second. Steps a worker's shim dropped before "
            "sending are not seen here (alert AvestBatchesRefused).",
            f"sum by (method, reason) (rate({sidecar(m.REFUSED_BATCHES)}[{RI}]))",
            "{{method}} {{reason}}",
        ),
        sparse(
            lay,
            "Failed calls by method and code",
            "Calls that ended with a status other than OK, per second. CANCELLED on "
            "Observe is normal when a worker stops.",
            f"sum by (method, code) (rate({sidecar(m.RPC_DURATION + '_count', NOT_OK)}[{RI}]))",
            "{{method}} {{code}}",
        ),
    ]
