"""Generate deploy/grafana/dashboards/avest.json (the provisioned dashboard).

    python deploy/grafana/build_dashboard.py          # write it
    python deploy/grafana/build_dashboard.py --check  # exit 1 if it is stale

Metric names come from :mod:`avest.metrics` (the service's single definition)
and from vLLM 0.33's ``SpecDecodingProm``; every panel uses the provisioned
Prometheus datasource by its fixed uid, so the file needs no import step.

The "acceptance through position i" panels need a running product over
positions, which PromQL has no function for: it is written out for positions
0 .. MAX_POSITIONS-1 as ``exp(sum(ln(p_j)) over j <= i)`` per position, joined
with ``or``. Pairs with more draft positions show the first MAX_POSITIONS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from avest import metrics as m
from avest.core.estimator import DEFAULT_RECENT_DECAY

OUT = Path(__file__).resolve().parent / "dashboards" / "avest.json"
DATASOURCE = {"type": "prometheus", "uid": "avest-prometheus"}
UID = "avest-overview"
#: Positions written out in the running-product (survival) expressions.
MAX_POSITIONS = 16
#: Thresholds drawn on the panels; the same numbers as deploy/prometheus/alerts.yml.
ECE_THRESHOLD = 0.05
DIVERGENCE_THRESHOLD = 0.1

# vLLM 0.33 (vllm/v1/spec_decode/metrics.py): labels model_name, engine (+ position).
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

PAIR = 'pair="$pair"'
VLLM_SEL = 'model_name="$target"'
RI = "$__rate_interval"


def survival(metric: str, max_positions: int = MAX_POSITIONS) -> str:
    """Per position i: the product of ``metric`` over positions 0..i of the pair
    (labels ``pair`` and ``position``), as one PromQL expression."""
    parts = []
    for i in range(max_positions):
        upto = "|".join(str(j) for j in range(i + 1))
        parts.append(
            f'label_replace(exp(sum by (pair) (ln({metric}{{{PAIR},position=~"{upto}"}})))'
            f' and on (pair) {metric}{{{PAIR},position="{i}"}}, "position", "{i}", "", "")'
        )
    return "\n or ".join(parts)


def vllm_per_position() -> str:
    return (
        f"sum by (position) (rate({VLLM_ACCEPTED_PER_POS}{{{VLLM_SEL}}}[{RI}]))\n"
        f"/ on () group_left sum(rate({VLLM_DRAFTS}{{{VLLM_SEL}}}[{RI}]))"
    )


def vllm_acceptance_length() -> str:
    return (
        f"1 + sum(rate({VLLM_ACCEPTED}{{{VLLM_SEL}}}[{RI}]))"
        f" / sum(rate({VLLM_DRAFTS}{{{VLLM_SEL}}}[{RI}]))"
    )


# -- panel builders -------------------------------------------------------------


class Layout:
    """Places panels left to right in rows of 24 grid units."""

    def __init__(self) -> None:
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1

    def place(self, w: int, h: int) -> dict[str, int]:
        if self.x + w > 24:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def new_row(self) -> dict[str, int]:
        self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        pos = {"h": 1, "w": 24, "x": 0, "y": self.y}
        self.y += 1
        return pos

    def id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def target(expr: str, legend: str = "__auto", ref: str = "A", instant: bool = False) -> dict:
    t: dict[str, Any] = {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "refId": ref,
    }
    if instant:
        t.update({"instant": True, "range": False, "format": "table"})
    else:
        t.update({"instant": False, "range": True})
    return t


def refs(*targets: tuple[str, str]) -> list[dict]:
    return [target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)]


def timeseries(
    lay: Layout,
    title: str,
    description: str,
    targets: list[dict],
    unit: str = "short",
    w: int = 12,
    h: int = 8,
    minimum: float | None = None,
    maximum: float | None = None,
    threshold: float | None = None,
    overrides: list[dict] | None = None,
    decimals: int | None = None,
) -> dict:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 0,
            "showPoints": "never",
            "spanNulls": True,
        },
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if decimals is not None:
        defaults["decimals"] = decimals
    if threshold is not None:
        defaults["thresholds"] = {
            "mode": "absolute",
            "steps": [{"color": "green", "value": None}, {"color": "red", "value": threshold}],
        }
        defaults["custom"]["thresholdsStyle"] = {"mode": "dashed"}
    return {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "gridPos": lay.place(w, h),
        "id": lay.id(),
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": targets,
        "title": title,
        "type": "timeseries",
    }


def stat(
    lay: Layout,
    title: str,
    description: str,
    expr: str,
    unit: str = "short",
    w: int = 4,
    mappings: list[dict] | None = None,
    thresholds: list[dict] | None = None,
) -> dict:
    return {
        "datasource": DATASOURCE,
        "description": description,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "mappings": mappings or [],
                "thresholds": {
                    "mode": "absolute",
                    "steps": thresholds or [{"color": "blue", "value": None}],
                },
            },
            "overrides": [],
        },
        "gridPos": lay.place(w, 4),
        "id": lay.id(),
        "options": {
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": "auto",
        },
        "targets": [target(expr, "__auto")],
        "title": title,
        "type": "stat",
    }


def row(lay: Layout, title: str) -> dict:
    return {
        "collapsed": False,
        "gridPos": lay.new_row(),
        "id": lay.id(),
        "panels": [],
        "title": title,
        "type": "row",
    }


def dashed(regex: str) -> dict:
    return {
        "matcher": {"id": "byRegexp", "options": regex},
        "properties": [
            {"id": "custom.lineStyle", "value": {"dash": [10, 10], "fill": "dash"}},
            {"id": "custom.lineWidth", "value": 2},
        ],
    }


def query_variable(name: str, label: str, query: str, hide: int = 0) -> dict:
    return {
        "current": {},
        "datasource": DATASOURCE,
        "definition": query,
        "hide": hide,
        "includeAll": False,
        "label": label,
        "multi": False,
        "name": name,
        "options": [],
        "query": {
            "qryType": 1,
            "query": query,
            "refId": "PrometheusVariableQueryEditor-VariableQuery",
        },
        "refresh": 2,
        "regex": "",
        "skipUrlSync": False,
        "sort": 1,
        "type": "query",
    }


# -- the dashboard --------------------------------------------------------------


def build() -> dict:
    lay = Layout()
    p: list[dict] = []

    p.append(row(lay, "Overview"))
    p.append(
        stat(
            lay,
            "Sidecar",
            "Prometheus's scrape of the avest admin HTTP port (job avest): UP or DOWN. "
            "Alert AvestSidecarDown fires after a minute down.",
            'up{job="avest"}',
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "DOWN", "color": "red", "index": 0},
                        "1": {"text": "UP", "color": "green", "index": 1},
                    },
                }
            ],
            thresholds=[{"color": "red", "value": None}, {"color": "green", "value": 1}],
        )
    )
    p.append(
        stat(lay, "Pairs", "Model pairs registered with (or restored by) the sidecar.", m.PAIRS)
    )
    p.append(
        stat(
            lay,
            "Coefficients version",
            "Version of the pair's coefficients in force: +1 per applied refit; what every "
            "worker of the pair is pushed.",
            f"{m.COEFFICIENTS_VERSION}{{{PAIR}}}",
        )
    )
    p.append(
        stat(
            lay,
            "Refit rounds",
            "Refit rounds closed for the pair (applied or not); one round per refit "
            "interval of observed steps pooled over all workers.",
            f"{m.ROUND}{{{PAIR}}}",
        )
    )
    p.append(
        stat(
            lay,
            "Drafts ingested",
            "Verified drafts per second folded into the pair's estimator, all workers together.",
            f"sum(rate({m.DRAFTS_OBSERVED}{{{PAIR}}}[{RI}]))",
            unit="ops",
        )
    )
    p.append(
        stat(
            lay,
            "Open streams",
            "Open Observe and WatchCoefficients streams: roughly one per connected vLLM "
            "worker (rank 0 of each tensor-parallel group).",
            m.OPEN_STREAMS,
        )
    )
    pair_table = {
        "datasource": DATASOURCE,
        "description": "The selected pair's key (avest_pair_info): target and draft model, "
        "speculative method, K, update rule and workload labels.",
        "fieldConfig": {"defaults": {}, "overrides": []},
        "gridPos": lay.place(24, 3),
        "id": lay.id(),
        "options": {"showHeader": True, "cellHeight": "sm"},
        "targets": [target(f"{m.PAIR_INFO}{{{PAIR}}}", "__auto", instant=True)],
        "title": "Pair",
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {
                        "Time": True,
                        "Value": True,
                        "__name__": True,
                        "instance": True,
                        "job": True,
                    },
                    "indexByName": {
                        "pair": 0,
                        "target": 1,
                        "draft": 2,
                        "method": 3,
                        "k": 4,
                        "rule": 5,
                        "labels": 6,
                    },
                },
            }
        ],
        "type": "table",
    }
    p.append(pair_table)

    p.append(row(lay, "Coefficients"))
    p.append(
        timeseries(
            lay,
            "Slope",
            "Shared slope w of the pair's logistic model p_i = sigmoid(w * x + b_i), x the "
            "draft's logit(q_max). Steps mark refits; a flat line while drafts flow means "
            "refits are held or rejected (see Refits by outcome).",
            [target(f"{m.SLOPE}{{{PAIR}}}", "slope")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Intercepts by position",
            "Per-position intercepts b_i of the coefficients in force (position 0 is the "
            "first draft token).",
            [target(f"{m.INTERCEPT}{{{PAIR}}}", "b{{position}}")],
        )
    )

    p.append(row(lay, "Acceptance"))
    p.append(
        timeseries(
            lay,
            "Acceptance per position: predicted vs observed (avest)",
            "For drafts whose position was verified: avest's mean predicted acceptance "
            "probability (solid) and the observed acceptance rate (dashed), per position, "
            "cumulative since the pair was registered or reset. Calibrated estimates "
            "put each pair of lines together.",
            refs(
                (f"{m.PREDICTED_ACCEPTANCE}{{{PAIR}}}", "predicted {{position}}"),
                (f"{m.OBSERVED_ACCEPTANCE}{{{PAIR}}}", "observed {{position}}"),
            ),
            unit="percentunit",
            minimum=0,
            maximum=1,
            overrides=[dashed("observed.*")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Recent acceptance per position: predicted vs observed (avest)",
            "The same over recent drafts only: each refit round down-weights older drafts "
            f"by {DEFAULT_RECENT_DECAY:g} (a window of about 20 rounds), so a workload shift shows here within "
            "a few thousand steps while the cumulative panel beside it barely moves. "
            "Alert AvestAcceptanceDivergence watches these.",
            refs(
                (f"{m.RECENT_PREDICTED_ACCEPTANCE}{{{PAIR}}}", "predicted {{position}}"),
                (f"{m.RECENT_OBSERVED_ACCEPTANCE}{{{PAIR}}}", "observed {{position}}"),
            ),
            unit="percentunit",
            minimum=0,
            maximum=1,
            overrides=[dashed("observed.*")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Acceptance through position i: avest vs vLLM",
            "Probability that drafts 0..i are all accepted. avest predicted / observed: "
            "running product of its per-position rates (cumulative). vLLM: "
            f"rate({VLLM_ACCEPTED_PER_POS}) / rate({VLLM_DRAFTS}) for model_name = the "
            "pair's target (vLLM's own counters, over the rate window). With adaptive "
            "verification vLLM counts positions the budget did not verify as not "
            "accepted, so its curve can sit below avest's at late positions.",
            refs(
                (survival(m.PREDICTED_ACCEPTANCE), "avest predicted {{position}}"),
                (survival(m.OBSERVED_ACCEPTANCE), "avest observed {{position}}"),
                (vllm_per_position(), "vLLM {{position}}"),
            ),
            unit="percentunit",
            minimum=0,
            maximum=1,
            overrides=[
                dashed("avest observed.*"),
                {
                    "matcher": {"id": "byRegexp", "options": "vLLM.*"},
                    "properties": [{"id": "custom.lineWidth", "value": 3}],
                },
            ],
        )
    )
    p.append(
        timeseries(
            lay,
            "Mean acceptance length (tokens per verification, incl. bonus)",
            "1 + expected accepted drafts per verification. avest: 1 + the sum of the "
            "'through position i' curves (predicted and observed). vLLM: 1 + "
            f"rate({VLLM_ACCEPTED}) / rate({VLLM_DRAFTS}), vLLM's own definition.",
            refs(
                (f"1 + sum by (pair) ({survival(m.PREDICTED_ACCEPTANCE)})", "avest predicted"),
                (f"1 + sum by (pair) ({survival(m.OBSERVED_ACCEPTANCE)})", "avest observed"),
                (vllm_acceptance_length(), "vLLM"),
            ),
            overrides=[dashed("avest observed")],
        )
    )

    p.append(row(lay, "Calibration"))
    p.append(
        timeseries(
            lay,
            "AUC",
            "Area under the ROC curve of avest's predictions against accept/reject: how "
            "well confidences rank drafts (0.5 = no better than chance), over recent drafts "
            "(solid; about the last 20 refit rounds) and all drafts since registration or "
            "reset (dashed). Empty until both outcomes are seen.",
            refs((f"{m.RECENT_AUC}{{{PAIR}}}", "recent"), (f"{m.AUC}{{{PAIR}}}", "all drafts")),
            unit="none",
            w=8,
            decimals=3,
            overrides=[dashed("all drafts")],
        )
    )
    p.append(
        timeseries(
            lay,
            "ECE",
            "Expected calibration error over 15 probability bins: mean |predicted - "
            "observed| weighted by drafts, over recent drafts (solid; about the last 20 "
            "refit rounds) and all drafts (dashed). Dashed red line: the threshold of "
            "AvestCalibrationDrift, which watches the recent ECE.",
            refs((f"{m.RECENT_ECE}{{{PAIR}}}", "recent"), (f"{m.ECE}{{{PAIR}}}", "all drafts")),
            unit="none",
            w=8,
            minimum=0,
            threshold=ECE_THRESHOLD,
            decimals=3,
            overrides=[dashed("all drafts")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Log loss",
            "Mean log loss of the predictions, nats per draft (lower is better), over "
            "recent drafts (solid; about the last 20 refit rounds) and all drafts (dashed).",
            refs(
                (f"{m.RECENT_LOG_LOSS}{{{PAIR}}}", "recent"),
                (f"{m.LOG_LOSS}{{{PAIR}}}", "all drafts"),
            ),
            unit="none",
            w=8,
            decimals=3,
            overrides=[dashed("all drafts")],
        )
    )
    p.append(
        timeseries(
            lay,
            "Predicted minus observed, by position (recent)",
            "Absolute gap between avest's mean predicted and the observed acceptance per "
            "position, over recent drafts (about the last 20 refit rounds). Dashed line: "
            "the AvestAcceptanceDivergence threshold (the alert watches exactly this).",
            [
                target(
                    f"abs({m.RECENT_PREDICTED_ACCEPTANCE}{{{PAIR}}}"
                    f" - {m.RECENT_OBSERVED_ACCEPTANCE}{{{PAIR}}})",
                    "position {{position}}",
                )
            ],
            unit="none",
            minimum=0,
            threshold=DIVERGENCE_THRESHOLD,
            decimals=3,
        )
    )
    p.append(
        timeseries(
            lay,
            "Labelled drafts behind the calibration",
            "Drafts the cumulative calibration gauges are computed over (since registration "
            "or reset). The calibration alerts wait for 10,000 before judging a pair.",
            [target(f"{m.CALIBRATION_DRAFTS}{{{PAIR}}}", "drafts")],
        )
    )

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
            "Alerts: AvestRefitsFailing, AvestRefitsRejected.",
            [
                target(
                    f"sum by (outcome) (increase({m.REFITS}{{{PAIR}}}[{RI}]))",
                    "{{outcome}}",
                )
            ],
            overrides=[
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
            ],
        )
    )
    refit_bucket = f"sum by (le) (rate({m.REFIT_DURATION}_bucket[{RI}]))"
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
            refs((m.QUEUE_DEPTH, "steps not yet durable"), (m.OPEN_STREAMS, "open streams")),
        )
    )

    p.append(row(lay, "RPC"))
    unary = 'method!~"Observe|WatchCoefficients"'
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
            "Calls (streams: when they end) completed per second, by method and gRPC status.",
            [
                target(
                    f"sum by (method, code) (rate({m.RPC_DURATION}_count[{RI}]))",
                    "{{method}} {{code}}",
                )
            ],
            unit="reqps",
        )
    )
    p.append(
        timeseries(
            lay,
            "Refused batches by method and reason",
            "Requests refused with the state untouched (invalid features or counts, wrong K, "
            "unknown pair, limits), per second. Steps a worker's shim dropped before "
            "sending are not seen here (alert AvestBatchesRefused).",
            [
                target(
                    f"sum by (method, reason) (rate({m.REFUSED_BATCHES}[{RI}]))",
                    "{{method}} {{reason}}",
                )
            ],
            unit="reqps",
        )
    )
    p.append(
        timeseries(
            lay,
            "Failed calls by method and code",
            "Calls that ended with a status other than OK, per second. CANCELLED on "
            "Observe is normal when a worker stops.",
            [
                target(
                    f'sum by (method, code) (rate({m.RPC_DURATION}_count{{code!="OK"}}[{RI}]))',
                    "{{method}} {{code}}",
                )
            ],
            unit="reqps",
        )
    )

    return {
        "annotations": {"list": []},
        "description": "avest: pooled acceptance estimates for speculative decoding in vLLM "
        "(coefficients, calibration, ingestion, refits, RPC).",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [],
        "panels": p,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["avest", "vllm", "speculative-decoding"],
        "templating": {
            "list": [
                query_variable("pair", "Pair", f"label_values({m.PAIR_INFO}, pair)"),
                query_variable(
                    "target",
                    "Target model",
                    f"label_values({m.PAIR_INFO}{{{PAIR}}}, target)",
                    hide=2,
                ),
            ]
        },
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "avest: acceptance estimator",
        "uid": UID,
        "version": 1,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
