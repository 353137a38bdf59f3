"""Names, types, labels and help of every avest Prometheus metric.

Every metric is defined once, here, in :data:`METRICS` (the dashboards, alert
rules and tests import the constants below, through :mod:`avest.metrics.registry`,
rather than spelling names). All names start with ``avest_``, use base units
(seconds, Unix time) and carry bounded labels only:

``pair``      the pair id (16 hex digits, at most ``max_pairs`` of them)
``position``  draft position, ``"0"`` .. ``"K-1"`` (0-based, as vLLM's
              ``vllm:spec_decode_num_accepted_tokens_per_pos_total``)
``method``    gRPC method: ``"Observe"`` etc. for ``avest.v1.EstimatorService``,
              ``"grpc.health.v1.Health/Check"`` style for the other services
``code``      gRPC status code name (``OK``, ``INVALID_ARGUMENT``, ...)
``outcome``   refit outcome, one of :data:`avest.core.rules.OUTCOMES`
``reason``    refusal reason, one of :data:`REFUSAL_REASONS`
``bin``       reliability bin, ``"0"`` .. ``"14"`` (see :data:`CURVE_METRICS`)
``worker``    a worker id, for at most :data:`WORKER_SERIES` workers per pair;
              ``"other"`` folds the rest

Per-pair series exist from the pair's registration (or restoration from the
store) on, before any observation. ``avest_drafts_observed_total`` and
``avest_steps_observed_total`` are the estimator's persisted totals, so they
continue across restarts and drop to 0 when the pair is reset through the
admin API (Prometheus treats that as a counter reset). ``avest_refits_total``
counts refits seen by this process.

Replicas (several processes on one PostgreSQL store, :mod:`avest.state.replicas`):
each pair's series, its worker table's included, come from its refitter alone,
so summed over the replicas a pair counts once. A fail-over moves them to the
replica that takes the pair over (both may export them for a scrape or two), so
read them aggregated over the replicas, ``by (pair)``: ``sum`` for the rates of
its counters, ``max`` for its gauges. The series that are not per pair are each
replica's own (streams, RPC, refusals, ``avest_queue_depth``: they add up);
``avest_pairs`` counts the pairs whose series the replica exports.

Calibration gauges (AUC, ECE, log loss, predicted and observed acceptance) are
the pair's cumulative calibration state (every draft since registration or the
last reset, each scored with the coefficients in force when it was applied).
The ``avest_recent_*`` gauges are the same measures over recent drafts: at
each refit the drafts of older rounds are down-weighted by
:data:`~avest.core.estimator.DEFAULT_RECENT_DECAY` (0.95, a window of about 20
refit rounds), so drift shows in them within a few thousand pooled steps while
the cumulative gauges move ever more slowly; the drift alerts watch them.
All are NaN while undefined (no drafts yet; AUC with only one class).
``avest_observed_acceptance{position=i}`` is the acceptance rate of drafts at
position ``i`` *given that position was verified* (the earlier drafts of the
row were accepted): a conditional rate. vLLM's
``rate(vllm:spec_decode_num_accepted_tokens_per_pos_total[5m]) /
rate(vllm:spec_decode_num_drafts_total[5m])`` is the unconditional rate,
comparable to the running product of avest's per-position rates, which
``avest_observed_survival`` exports (see :data:`CURVE_METRICS`).
"""

from __future__ import annotations

from dataclasses import dataclass

from avest.core.estimator import DEFAULT_RECENT_DECAY
from avest_wire.bins import ECE_BINS

PREFIX = "avest_"

# -- names ---------------------------------------------------------------------

INFO = "avest_info"
PAIRS = "avest_pairs"
PAIR_INFO = "avest_pair_info"
SLOPE = "avest_slope"
INTERCEPT = "avest_intercept"
COEFFICIENTS_VERSION = "avest_coefficients_version"
ROUND = "avest_round"
#: Per pair and stratum (docs/strata.md; at most ``MAX_STRATA`` values of ``stratum``
#: per pair): the stratum's served slope and its labelled drafts; per pair, the rows
#: predicted with the pair's coefficients because their stratum found no place.
STRATUM_SLOPE = "avest_stratum_slope"
STRATUM_DRAFTS = "avest_stratum_drafts"
STRATUM_ECE = "avest_stratum_ece"
STRATUM_LOG_LOSS = "avest_stratum_log_loss"
STRATA_FALLBACK_ROWS = "avest_strata_fallback_rows_total"
#: The series that exist only for a pair with strata.
STRATUM_METRICS = frozenset({STRATUM_SLOPE, STRATUM_DRAFTS, STRATUM_ECE, STRATUM_LOG_LOSS})
#: Per pair, hardware label and schedule range: the expected goodput of what the
#: draft-length schedule last computed runs there (``choice="scheduled"``) and of the
#: best fixed length without AV (``choice="best_fixed"``), tokens per second at the
#: range's first batch size. At most ``MAX_RANGES`` ranges per label (bounded).
SCHEDULE_GOODPUT = "avest_schedule_expected_goodput_tokens_per_second"
SCHEDULE_LENGTH = "avest_schedule_num_speculative_tokens"
#: Exported once a pair's schedule was asked for (GetSchedule, the admin API).
SCHEDULE_METRICS = (SCHEDULE_GOODPUT, SCHEDULE_LENGTH)
AUC = "avest_auc"
ECE = "avest_ece"
LOG_LOSS = "avest_log_loss"
CALIBRATION_DRAFTS = "avest_calibration_drafts"
PREDICTED_ACCEPTANCE = "avest_predicted_acceptance"
OBSERVED_ACCEPTANCE = "avest_observed_acceptance"
RECENT_AUC = "avest_recent_auc"
RECENT_ECE = "avest_recent_ece"
RECENT_LOG_LOSS = "avest_recent_log_loss"
RECENT_PREDICTED_ACCEPTANCE = "avest_recent_predicted_acceptance"
RECENT_OBSERVED_ACCEPTANCE = "avest_recent_observed_acceptance"
LAST_OBSERVED = "avest_last_observed_timestamp_seconds"
DRAFTS_OBSERVED = "avest_drafts_observed_total"
STEPS_OBSERVED = "avest_steps_observed_total"
REFITS = "avest_refits_total"
REFIT_DURATION = "avest_refit_duration_seconds"
RPC_DURATION = "avest_rpc_duration_seconds"
LOOP_LAG = "avest_event_loop_lag_seconds"
STORE_WRITE_DURATION = "avest_store_write_duration_seconds"
OPEN_STREAMS = "avest_open_streams"
OVERLOADED = "avest_overloaded"
ADMISSION_QUEUED = "avest_admission_queued"
BACKPRESSURE_WAITS = "avest_backpressure_waits_total"
QUEUE_DEPTH = "avest_queue_depth"
REFUSED_BATCHES = "avest_refused_batches_total"
STORE_ERRORS = "avest_store_errors_total"
STORE_WRITABLE = "avest_store_writable"
QUARANTINED_PAIRS = "avest_quarantined_pairs"
# Replicas on PostgreSQL (avest.state.replicas): each replica's own part.
REPLICA_INFO = "avest_replica_info"
REPLICA_PAIRS_REFITTED = "avest_replica_pairs_refitted"
REPLICAS_LIVE = "avest_replicas_live"
PENDING_FOLDED = "avest_pending_rows_folded_total"
PENDING_DROPPED = "avest_pending_rows_dropped_total"
#: Exported by replicas only: one process on a SQLite store has none of them.
REPLICA_METRICS = (
    REPLICA_INFO,
    REPLICA_PAIRS_REFITTED,
    REPLICAS_LIVE,
    PENDING_FOLDED,
    PENDING_DROPPED,
)
# The calibration layer (avest.core.calibration), per pair.
CALIBRATION_LAYER_SERVED = "avest_calibration_layer_served"
CALIBRATION_LAYER_GAIN = "avest_calibration_layer_logloss_gain"
WORKERS = "avest_workers"
WORKERS_FORGOTTEN = "avest_workers_forgotten_total"
WORKERS_QUARANTINED = "avest_workers_quarantined"
QUARANTINED_STEPS = "avest_quarantined_steps_total"
WORKER_DRAFTS = "avest_worker_drafts"
WORKER_STEPS = "avest_worker_steps"
WORKER_SUMMARIES = "avest_worker_summaries"
WORKER_LAG = "avest_worker_coefficients_lag"
WORKER_LAST_SEEN = "avest_worker_last_seen_timestamp_seconds"
#: Per pair, the most recently seen workers with series of their own; the rest
#: are folded into ``worker="other"`` (bounded cardinality).
WORKER_SERIES = 16

#: Values of the ``reason`` label of :data:`REFUSED_BATCHES` (the gRPC adapter's
#: refusal reasons); anything else is counted as ``other``.
REFUSAL_REASONS = (
    "invalid_argument",
    "not_found",
    "resource_exhausted",
    "failed_precondition",
    "already_exists",
    "malformed",
    "unauthenticated",
    "permission_denied",
    "other",
)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family as exposed: ``name`` is what PromQL uses (counters
    end in ``_total``; a histogram's samples add ``_bucket``, ``_sum`` and
    ``_count``)."""

    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    labels: tuple[str, ...]
    help: str

    def sample_names(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


#: How the help of the ``avest_recent_*`` gauges describes their window.
_RECENT = (
    f"recent drafts (each refit round down-weights older ones by {DEFAULT_RECENT_DECAY:g}: "
    "a window of about 20 rounds)"
)

# -- the dashboard's curves: survival through position i, reliability bins -------
#
# Survival through position ``i`` is the running product over positions
# ``0..i`` of the cumulative per-position gauges above: with
# ``avest_predicted_acceptance`` the probability the estimator gave a run of
# ``i + 1`` accepted drafts, with ``avest_observed_acceptance`` (conditional
# rates, so the product telescopes) the fraction of drafts whose positions
# ``0..i`` were all accepted: what vLLM's
# ``rate(..._accepted_tokens_per_pos_total) / rate(..._num_drafts_total)``
# counts, and ``1 + sum over i`` is the mean acceptance length. NaN from the
# first position without drafts on. The reliability bins are the cumulative
# reliability diagram, every position pooled (what ``/v1/pairs/{id}/reliability``
# and its SVG draw without ``position``): bin ``b`` (``"0"`` .. ``"14"``) holds
# the drafts predicted in ``[b/15, (b+1)/15)`` (:data:`~avest.core.metrics.ECE_BINS`
# bins). Per pair: ``2 K + 3 * 15`` series.

PREDICTED_SURVIVAL = "avest_predicted_survival"
OBSERVED_SURVIVAL = "avest_observed_survival"
RELIABILITY_DRAFTS = "avest_reliability_drafts"
RELIABILITY_PREDICTED = "avest_reliability_predicted"
RELIABILITY_OBSERVED = "avest_reliability_observed"

CURVE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        PREDICTED_SURVIVAL,
        "gauge",
        ("pair", "position"),
        "Predicted probability that drafts 0..position are all accepted: running product of "
        f"{PREDICTED_ACCEPTANCE} (all drafts since registration or reset).",
    ),
    MetricSpec(
        OBSERVED_SURVIVAL,
        "gauge",
        ("pair", "position"),
        "Observed fraction of drafts whose positions 0..position were all accepted: running "
        f"product of {OBSERVED_ACCEPTANCE} (all drafts since registration or reset).",
    ),
    MetricSpec(
        RELIABILITY_DRAFTS,
        "gauge",
        ("pair", "bin"),
        f"Labelled drafts whose predicted acceptance fell in the bin [bin/{ECE_BINS}, "
        f"(bin+1)/{ECE_BINS}), all positions pooled (all drafts since registration or reset).",
    ),
    MetricSpec(
        RELIABILITY_PREDICTED,
        "gauge",
        ("pair", "bin"),
        "Mean predicted acceptance of the bin's drafts (NaN while the bin is empty).",
    ),
    MetricSpec(
        RELIABILITY_OBSERVED,
        "gauge",
        ("pair", "bin"),
        "Observed acceptance rate of the bin's drafts (NaN while the bin is empty).",
    ),
)


#: Every avest metric, in exposition order.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(INFO, "gauge", ("version",), "Always 1; the avest version serving."),
    MetricSpec(
        PAIRS,
        "gauge",
        (),
        "Model pairs registered (or restored) whose series this process exports: every "
        "pair on one process, the pairs it refits on a replica, so that the sum over "
        "the replicas is the pairs held.",
    ),
    MetricSpec(
        PAIR_INFO,
        "gauge",
        ("pair", "target", "draft", "method", "k", "rule", "labels"),
        "Always 1; names of each pair (labels: its key labels as k=v,... sorted).",
    ),
    MetricSpec(SLOPE, "gauge", ("pair",), "Shared slope of the coefficients in force."),
    MetricSpec(
        INTERCEPT, "gauge", ("pair", "position"), "Per-position intercept of the coefficients."
    ),
    MetricSpec(
        COEFFICIENTS_VERSION,
        "gauge",
        ("pair",),
        "Version of the coefficients in force (+1 per applied refit and per reset).",
    ),
    MetricSpec(ROUND, "gauge", ("pair",), "Refit rounds closed (applied or not)."),
    MetricSpec(
        STRATUM_SLOPE,
        "gauge",
        ("pair", "stratum"),
        "Served slope of each stratum of the pair (at most 16 strata per pair).",
    ),
    MetricSpec(
        STRATUM_DRAFTS,
        "gauge",
        ("pair", "stratum"),
        "Labelled drafts of each stratum of the pair since it was placed.",
    ),
    MetricSpec(
        STRATUM_ECE,
        "gauge",
        ("pair", "stratum"),
        "Expected calibration error (15 bins) of what each stratum served; NaN before a draft.",
    ),
    MetricSpec(
        STRATUM_LOG_LOSS,
        "gauge",
        ("pair", "stratum"),
        "Mean log loss (nats per draft) of what each stratum served; NaN before a draft.",
    ),
    MetricSpec(
        STRATA_FALLBACK_ROWS,
        "counter",
        ("pair",),
        "Rows predicted with the pair's coefficients because the pair held its limit of "
        "strata when their stratum came.",
    ),
    MetricSpec(
        SCHEDULE_GOODPUT,
        "gauge",
        ("pair", "hardware", "range_start", "choice"),
        "Expected goodput at the first batch size of each range of the pair's last computed "
        "draft-length schedule (GetSchedule): of the scheduled choice (choice=scheduled) and of "
        "the best fixed length without adaptive verification (choice=best_fixed).",
    ),
    MetricSpec(
        SCHEDULE_LENGTH,
        "gauge",
        ("pair", "hardware", "range_start", "range_end"),
        "Drafts per request of each range of the pair's last computed draft-length schedule "
        "(0: speculation off).",
    ),
    MetricSpec(
        AUC, "gauge", ("pair",), "AUC of the predictions (NaN until both outcomes are seen)."
    ),
    MetricSpec(ECE, "gauge", ("pair",), "Expected calibration error over 15 probability bins."),
    MetricSpec(LOG_LOSS, "gauge", ("pair",), "Mean log loss (nats per draft) of the predictions."),
    MetricSpec(
        CALIBRATION_DRAFTS,
        "gauge",
        ("pair",),
        "Labelled drafts the calibration gauges are computed over.",
    ),
    MetricSpec(
        PREDICTED_ACCEPTANCE,
        "gauge",
        ("pair", "position"),
        "Mean predicted acceptance probability of verified drafts at the position.",
    ),
    MetricSpec(
        OBSERVED_ACCEPTANCE,
        "gauge",
        ("pair", "position"),
        "Observed acceptance rate of verified drafts at the position (conditional on reaching it).",
    ),
    MetricSpec(
        RECENT_AUC,
        "gauge",
        ("pair",),
        f"AUC of the predictions over {_RECENT}; NaN until both outcomes are seen.",
    ),
    MetricSpec(
        RECENT_ECE,
        "gauge",
        ("pair",),
        f"Expected calibration error (15 bins) over {_RECENT}.",
    ),
    MetricSpec(
        RECENT_LOG_LOSS,
        "gauge",
        ("pair",),
        f"Mean log loss (nats per draft) of the predictions over {_RECENT}.",
    ),
    MetricSpec(
        RECENT_PREDICTED_ACCEPTANCE,
        "gauge",
        ("pair", "position"),
        f"Mean predicted acceptance probability of verified drafts at the position, over {_RECENT}.",
    ),
    MetricSpec(
        RECENT_OBSERVED_ACCEPTANCE,
        "gauge",
        ("pair", "position"),
        "Observed acceptance rate of verified drafts at the position (conditional on reaching "
        f"it), over {_RECENT}.",
    ),
    MetricSpec(
        LAST_OBSERVED,
        "gauge",
        ("pair",),
        "Unix time of the last step applied to the pair (its registration before any).",
    ),
    MetricSpec(
        DRAFTS_OBSERVED,
        "counter",
        ("pair",),
        "Labelled (verified) drafts folded into the pair since registration or reset.",
    ),
    MetricSpec(
        STEPS_OBSERVED,
        "counter",
        ("pair",),
        "Observe steps applied to the pair since registration or reset (duplicates excluded).",
    ),
    MetricSpec(
        REFITS, "counter", ("pair", "outcome"), "Refits by outcome, counted by this process."
    ),
    MetricSpec(
        REFIT_DURATION,
        "histogram",
        (),
        "Seconds to apply the step that closes a round and refit.",
    ),
    MetricSpec(
        RPC_DURATION,
        "histogram",
        ("method", "code"),
        "gRPC call duration in seconds (streams: the whole call) by method and status code.",
    ),
    MetricSpec(
        LOOP_LAG,
        "histogram",
        (),
        "How late the service's event loop ran its heartbeat (due every 0.5 s), in "
        "seconds: what every callback on the loop (an Observe message, a unary call, an "
        "admin request) waits for at least; /healthz answers 503 once the loop has not "
        "run it for 10 s.",
    ),
    MetricSpec(
        STORE_WRITE_DURATION,
        "histogram",
        (),
        "Group commit: seconds from the snapshot of a chunk of changed pairs to their "
        "acknowledgements, the store's write included (a replica: its append to the "
        "pending log); what a worker's ack waits for after --flush-interval-ms.",
    ),
    MetricSpec(OPEN_STREAMS, "gauge", (), "Open Observe and WatchCoefficients streams."),
    MetricSpec(
        OVERLOADED,
        "gauge",
        (),
        "1 while Observe streams wait for room in some pair's full queue (--pair-queue): "
        "they are read no further until there is room, else 0.",
    ),
    MetricSpec(
        ADMISSION_QUEUED,
        "gauge",
        (),
        "Observe messages checked and waiting in their pairs' queues to be applied.",
    ),
    MetricSpec(
        BACKPRESSURE_WAITS,
        "counter",
        (),
        "Observe messages that found their pair's queue full: their stream read nothing more "
        "until there was room (HTTP/2 flow control held the sender back); nothing is "
        "refused or lost.",
    ),
    MetricSpec(
        QUEUE_DEPTH,
        "gauge",
        (),
        "Observe steps applied but not yet durable (so not yet acknowledged), summed over "
        "pairs and workers, counted in sequence numbers; on a replica, the steps and round "
        "summaries it received and has not yet written to the pending log (each replica "
        "its own: they add up).",
    ),
    MetricSpec(
        REFUSED_BATCHES,
        "counter",
        ("method", "reason"),
        "Requests refused (state untouched) by method and reason.",
    ),
    MetricSpec(
        STORE_ERRORS,
        "counter",
        ("operation",),
        "Failed store operations (write, delete) since the process started; "
        "while writes fail no step is acknowledged.",
    ),
    MetricSpec(
        STORE_WRITABLE,
        "gauge",
        (),
        "1 while the last store write succeeded, 0 while writes fail (disk full, read-only); "
        "/readyz then answers 503 with the reason.",
    ),
    MetricSpec(
        REPLICA_INFO,
        "gauge",
        ("replica",),
        "1, labelled with this replica's name (--replica-name), on a PostgreSQL store: every "
        "process on one database is a replica.",
    ),
    MetricSpec(
        REPLICA_PAIRS_REFITTED,
        "gauge",
        (),
        "Pairs this replica refits (holds the advisory lock of); summed over the replicas, "
        "the pairs held. Each pair's series are exported by its refitter alone.",
    ),
    MetricSpec(
        REPLICAS_LIVE,
        "gauge",
        (),
        "Replicas whose heartbeat this replica saw in the last few seconds.",
    ),
    MetricSpec(
        PENDING_FOLDED,
        "counter",
        (),
        "Pending log rows (round summaries, raw steps, admin changes from any replica) this "
        "replica folded into the pairs it refits.",
    ),
    MetricSpec(
        PENDING_DROPPED,
        "counter",
        (),
        "Pending log rows this replica could not decode (written by another release) and "
        "dropped, logged with the pair and worker.",
    ),
    MetricSpec(
        QUARANTINED_PAIRS,
        "gauge",
        (),
        "Pairs whose stored state failed its checksum or did not load at start: kept aside "
        "in the store's quarantine table and listed by /readyz; the other pairs serve. "
        "Replicas each load the one store and report the same pairs: read it with max.",
    ),
    *CURVE_METRICS,
    # -- the calibration layer ---------------------------------------------------
    MetricSpec(
        CALIBRATION_LAYER_SERVED,
        "gauge",
        ("pair",),
        "1 while the pair's calibration layer (a monotone map over the linear predictor) is "
        "served by Score and in the pushed coefficients, else 0.",
    ),
    MetricSpec(
        CALIBRATION_LAYER_GAIN,
        "gauge",
        ("pair",),
        "Recent predictive log loss of the plain logistic minus the calibration layer's, nats "
        "per draft (positive: the layer is better); NaN before any draft.",
    ),
    MetricSpec(WORKERS, "gauge", ("pair",), "Workers remembered for the pair (at most 4096)."),
    MetricSpec(WORKERS_FORGOTTEN, "counter", ("pair",), "Workers forgotten, oldest first."),
    MetricSpec(
        WORKERS_QUARANTINED,
        "gauge",
        ("pair",),
        "Workers quarantined now: their recent acceptance is implausible under the model "
        "the other workers agree on; their data is scored, not folded.",
    ),
    MetricSpec(
        QUARANTINED_STEPS,
        "counter",
        ("pair",),
        "Decode steps scored but not folded because their worker was quarantined.",
    ),
)
_WORKER = f'the {WORKER_SERIES} workers seen last have their own series, the rest worker="other"'
_PW = ("pair", "worker")
#: Per-worker series: they exist once a pair has seen a worker (bounded: see WORKER_SERIES).
WORKER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(WORKER_DRAFTS, "gauge", _PW, f"Labelled drafts sent; {_WORKER}."),
    MetricSpec(WORKER_STEPS, "gauge", _PW, f"Decode steps covered (summaries and raw); {_WORKER}."),
    MetricSpec(WORKER_SUMMARIES, "gauge", _PW, f"Round summaries applied; {_WORKER}."),
    MetricSpec(WORKER_LAG, "gauge", _PW, f"Versions its last summary was behind; {_WORKER}."),
    MetricSpec(WORKER_LAST_SEEN, "gauge", _PW, f"Unix time last applied; {_WORKER}."),
)
SPECS: dict[str, MetricSpec] = {m.name: m for m in (*METRICS, *WORKER_METRICS)}


def exposed_names() -> frozenset[str]:
    """Every sample name avest exposes (for checking dashboards and rules)."""
    return frozenset(n for m in (*METRICS, *WORKER_METRICS) for n in m.sample_names())


def family_name(name: str) -> str:
    """The name prometheus_client wants for a family (counters without ``_total``)."""
    return name[: -len("_total")] if name.endswith("_total") else name
