"""Rows about the service: Ingestion and refits, RPC."""

from __future__ import annotations

from avest.http import metrics as m

from .panels import HIDE_WHEN_ZERO, Layout, dashed, refs, row, target, timeseries
from .queries import PAIR, RI, SIDECAR, sidecar

NOT_OK = 'code!="OK"'


def ingestion(lay: Layout) -> list[dict]:
    """The "Ingestion and refits" row and its panels."""
    p: list[dict] = []

    p.append(row(lay, "Ingestion and refits"))
    p.append(
        timeseries(
            lay,
            "Drafts and steps ingested per second",
            "Verified drafts (labelled positions) and Observe steps applied per second for "
            "the pair, pooled over workers. Zero while vLLM serves traffic means the shim "
            "is not forwarding (alert AvestPairNoObservations).",
            refs(
                (f"sum(rate({m.DRAFTS_OBSERVED}{{{PAIR}}}[{RI}]))", "drafts/s"),
                (f"sum(rate({m.STEPS_OBSERVED}{{{PAIR}}}[{RI}]))", "steps/s"),
            ),
            unit="ops",
        )
    )
    p.append(
        timeseries(
            lay,
            "Refits by outcome",
            "Refits per rate window by outcome: applied; slope_held (the slope step was "
            "dropped: negative or NaN); rejected (non-finite solve, nothing changed). "
            "Alerts: AvestRefitsFailing, AvestRefitsRejected. Series at zero all along are hidden.",
            [
                target(
                    f"sum by (outcome) (increase({m.REFITS}{{{PAIR}}}[{RI}]))",
                    "{{outcome}}",
                )
            ],
            overrides=[
                HIDE_WHEN_ZERO,
                *(
                    {
                        "matcher": {"id": "byName", "options": name},
                        "properties": [
                            {"id": "color", "value": {"mode": "fixed", "fixedColor": color}}
                        ],
                    }
                    for name, color in (
                        ("applied", "green"),
                        ("slope_held", "orange"),
                        ("rejected", "red"),
                    )
                ),
            ],
        )
    )
    refit_bucket = f"sum by (le) (rate({sidecar(m.REFIT_DURATION + '_bucket')}[{RI}]))"
    p.append(
        timeseries(
            lay,
            "Refit latency",
            "Seconds to apply the step that closes a round and refit (all pairs), "
            "quantiles from avest_refit_duration_seconds.",
            refs(
                (f"histogram_quantile(0.5, {refit_bucket})", "p50"),
                (f"histogram_quantile(0.9, {refit_bucket})", "p90"),
                (f"histogram_quantile(0.99, {refit_bucket})", "p99"),
            ),
            unit="s",
        )
    )
    p.append(
        timeseries(
            lay,
            "Durability backlog and streams",
            "Observe steps applied but not yet durable (hence not yet acknowledged), and "
            "open streams. A growing backlog means group commits lag: workers hold more "
            "unacknowledged steps and may drop the oldest (alert AvestObserveBacklog).",
            refs(
                (sidecar(m.QUEUE_DEPTH), "steps not yet durable"),
                (sidecar(m.OPEN_STREAMS), "open streams"),
            ),
        )
    )
    return p


def rpc(lay: Layout) -> list[dict]:
    """The "RPC" row and its panels."""
    p: list[dict] = []

    p.append(row(lay, "RPC"))
    unary = f'{SIDECAR},method!~"Observe|WatchCoefficients"'
    rpc_bucket = f"sum by (le, method) (rate({m.RPC_DURATION}_bucket{{{unary}}}[{RI}]))"
    p.append(
        timeseries(
            lay,
            "Unary RPC latency by method",
            "p50 (dashed) and p99 of unary calls (RegisterPair, Score, Budget, ...) by "
            "method. Streams are left out: their duration is the stream's lifetime.",
            refs(
                (f"histogram_quantile(0.99, {rpc_bucket})", "{{method}} p99"),
                (f"histogram_quantile(0.5, {rpc_bucket})", "{{method}} p50"),
            ),
            unit="s",
            overrides=[dashed(".* p50")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Calls completed by method and code",
            "Calls (streams: when they end) completed per second, by method and gRPC status. Series at zero all along are hidden.",
            [
                target(
                    f"sum by (method, code) (rate({sidecar(m.RPC_DURATION + '_count')}[{RI}]))",
                    "{{method}} {{code}}",
                )
            ],
            unit="reqps",
            overrides=[HIDE_WHEN_ZERO],
        )
    )
    p.append(
        timeseries(
            lay,
            "Refused batches by method and reason",
            "Requests refused with the state untouched (invalid features or counts, wrong K, "
            "unknown pair, limits), per second. Steps a worker's shim dropped before "
            "sending are not seen here (alert AvestBatchesRefused). Series at zero all along are hidden.",
            [
                target(
                    f"sum by (method, reason) (rate({sidecar(m.REFUSED_BATCHES)}[{RI}]))",
                    "{{method}} {{reason}}",
                )
            ],
            unit="reqps",
            overrides=[HIDE_WHEN_ZERO],
        )
    )
    p.append(
        timeseries(
            lay,
            "Failed calls by method and code",
            "Calls that ended with a status other than OK, per second. CANCELLED on "
            "Observe is normal when a worker stops. Series at zero all along are hidden.",
            [
                target(
                    f"sum by (method, code) (rate({sidecar(m.RPC_DURATION + '_count', NOT_OK)}[{RI}]))",
                    "{{method}} {{code}}",
                )
            ],
            unit="reqps",
            overrides=[HIDE_WHEN_ZERO],
        )
    )
    return p
