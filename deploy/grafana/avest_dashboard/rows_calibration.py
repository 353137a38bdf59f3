"""The "Calibration" row, near the top: AUC, ECE, log loss, the reliability
diagram from the sidecar's exported bins beside a link to its SVG, the
per-position gap the divergence alert watches."""

from __future__ import annotations

from typing import Any

from avest.core.metrics import ECE_BINS
from avest.metrics import names as m
from avest.metrics.names import CALIBRATION_LAYER_GAIN, CALIBRATION_LAYER_SERVED

from .panels import (
    DATASOURCE,
    Layout,
    dashed,
    refs,
    right_axis_step,
    row,
    target,
    text,
    timeseries,
)
from .queries import DIVERGENCE_THRESHOLD, ECE_THRESHOLD, pair, pair_gauge

#: The sidecar's admin HTTP address as the viewer's browser reaches it (the
#: ``avest_url`` variable): what the SVG link points at.
AVEST_URL_DEFAULT = "http://localhost:8000"
SVG_PATH = "/v1/pairs/${pair}/reliability.svg"


def recent_vs_all(
    lay: Layout,
    title: str,
    description: str,
    recent: str,
    cumulative: str,
    minimum: float | None = None,
    threshold: float | None = None,
) -> dict:
    """A score of the predictions, a third of the row wide: over recent drafts
    (solid) and all drafts since registration or reset (dashed)."""
    return timeseries(
        lay,
        title,
        description,
        refs((pair_gauge(recent), "recent"), (pair_gauge(cumulative), "all drafts")),
        unit="none",
        w=8,
        minimum=minimum,
        threshold=threshold,
        decimals=3,
        overrides=[dashed("all drafts")],
    )


def calibration(lay: Layout) -> list[dict]:
    """The "Calibration" row and its panels."""
    return [
        row(lay, "Calibration"),
        recent_vs_all(
            lay,
            "AUC",
            "Area under the ROC curve of avest's predictions against accept/reject: how "
            "well confidences rank drafts (0.5 = no better than chance), over recent drafts "
            "(solid; about the last 20 refit rounds) and all drafts since registration or "
            "reset (dashed). Empty until both outcomes are seen.",
            m.RECENT_AUC,
            m.AUC,
        ),
        recent_vs_all(
            lay,
            "ECE",
            "Expected calibration error over 15 probability bins: mean |predicted - "
            "observed| weighted by drafts, over recent drafts (solid; about the last 20 "
            "refit rounds) and all drafts (dashed). Dashed red line: the threshold of "
            "AvestCalibrationDrift, which watches the recent ECE.",
            m.RECENT_ECE,
            m.ECE,
            minimum=0,
            threshold=ECE_THRESHOLD,
        ),
        recent_vs_all(
            lay,
            "Log loss",
            "Mean log loss of the predictions, nats per draft (lower is better), over "
            "recent drafts (solid; about the last 20 refit rounds) and all drafts (dashed).",
            m.RECENT_LOG_LOSS,
            m.LOG_LOSS,
        ),
        *reliability(lay),
        timeseries(
            lay,
            "Predicted minus observed, by position (recent)",
            "Absolute gap between avest's mean predicted and the observed acceptance per "
            "position, over recent drafts (about the last 20 refit rounds). Dashed line: "
            "the AvestAcceptanceDivergence threshold (the alert watches exactly this).",
            [
                target(
                    f"abs({pair_gauge(m.RECENT_PREDICTED_ACCEPTANCE, 'position')}"
                    f" - {pair_gauge(m.RECENT_OBSERVED_ACCEPTANCE, 'position')})",
                    "position {{position}}",
                )
            ],
            unit="none",
            w=10,
            h=9,
            minimum=0,
            threshold=DIVERGENCE_THRESHOLD,
            decimals=3,
        ),
        timeseries(
            lay,
            "Labelled drafts behind the calibration",
            "Drafts the cumulative calibration gauges are computed over (since registration "
            "or reset). The calibration alerts wait for 10,000 before judging a pair.",
            [target(pair_gauge(m.CALIBRATION_DRAFTS), "drafts")],
            w=12,
            h=6,
        ),
        timeseries(
            lay,
            "Calibration layer",
            "The monotone map over the linear predictor (avest.core.calibration). Gain: "
            "the plain logistic's recent log loss minus the layer's, nats per draft "
            "(above 0: the layer predicts better). Served (right axis, 0 or 1): whether "
            "Score, Budget and the shims' tables use it now; it is served only while the "
            "gain is clearly positive. Empty for a pair without a layer yet.",
            refs(
                (pair_gauge(CALIBRATION_LAYER_GAIN), "gain"),
                (pair_gauge(CALIBRATION_LAYER_SERVED), "served"),
            ),
            unit="none",
            w=12,
            h=6,
            decimals=4,
            overrides=[right_axis_step("served")],
        ),
    ]


def _bin_names() -> list[dict[str, Any]]:
    """Value mappings that show reliability bin b as its probability range."""
    options = {
        str(b): {"index": b, "text": f"{100 * b / ECE_BINS:.0f}-{100 * (b + 1) / ECE_BINS:.0f}%"}
        for b in range(ECE_BINS)
    }
    return [{"type": "value", "options": options}]


def reliability(lay: Layout) -> list[dict]:
    """The reliability diagram (bar chart of the exported bins) and the SVG link."""
    names = {"Value #A": "mean predicted", "Value #B": "observed", "Value #C": "drafts"}
    bars = {
        "datasource": DATASOURCE,
        "description": "Reliability diagram of all the pair's labelled drafts since registration "
        f"or reset, every position pooled: per predicted-probability bin (1/{ECE_BINS} wide), "
        "the mean predicted acceptance (bar 1) and the observed acceptance rate (bar 2) of the "
        "drafts in it; calibrated estimates give equal bars. The tooltip gives the bin's draft "
        f"count ({m.RELIABILITY_DRAFTS}); empty bins have no bars. The link above opens the "
        "sidecar's own drawing of it (SVG).",
        "fieldConfig": {
            "defaults": {"unit": "percentunit", "min": 0, "max": 1, "decimals": 2},
            "overrides": [
                {
                    "matcher": {"id": "byName", "options": "bin"},
                    "properties": [{"id": "mappings", "value": _bin_names()}],
                },
                {
                    "matcher": {"id": "byName", "options": "drafts"},
                    "properties": [
                        {"id": "unit", "value": "short"},
                        {"id": "decimals", "value": 0},
                        {
                            "id": "custom.hideFrom",
                            "value": {"legend": True, "tooltip": False, "viz": True},
                        },
                    ],
                },
            ],
        },
        "gridPos": lay.place(10, 9),
        "id": lay.id(),
        "links": [
            {
                "targetBlank": True,
                "title": "Reliability diagram of this pair (SVG, from the sidecar)",
                "url": "${avest_url}" + SVG_PATH,
            }
        ],
        "options": {
            "barWidth": 0.9,
            "groupWidth": 0.8,
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "orientation": "vertical",
            "showValue": "never",
            "stacking": "none",
            "tooltip": {"mode": "multi", "sort": "none"},
            "xField": "bin",
            "xTickLabelRotation": -45,
        },
        "targets": [
            target(f"max by (bin) ({pair(name)})", ref=ref, instant=True)
            for ref, name in (
                ("A", m.RELIABILITY_PREDICTED),
                ("B", m.RELIABILITY_OBSERVED),
                ("C", m.RELIABILITY_DRAFTS),
            )
        ],
        "title": "Reliability diagram (all drafts)",
        "transformations": [
            # Without the evaluation time, the three tables merge on bin alone.
            {"id": "filterFieldsByName", "options": {"exclude": {"names": ["Time"]}}},
            {"id": "merge", "options": {}},
            # Sort the bins as numbers ("10" sorts before "2" as text).
            {
                "id": "convertFieldType",
                "options": {
                    "conversions": [{"targetField": "bin", "destinationType": "number"}],
                    "fields": {},
                },
            },
            {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "bin", "desc": False}]}},
            # Back to text: the bar chart's x axis is a category (string) field.
            {
                "id": "convertFieldType",
                "options": {
                    "conversions": [{"targetField": "bin", "destinationType": "string"}],
                    "fields": {},
                },
            },
            {
                "id": "organize",
                "options": {"renameByName": names},
            },
        ],
        "type": "barchart",
    }
    link = text(
        lay,
        "Reliability diagram (SVG)",
        "A link to the sidecar's own reliability diagram of the pair (GET "
        "/v1/pairs/{pair_id}/reliability.svg on its admin HTTP port), drawn from the same bins "
        "with predicted vs observed acceptance per position beside it.",
        "### [Open the SVG](${avest_url}" + SVG_PATH + ")\n\n"
        "The sidecar draws this pair's reliability diagram from the same bins, with the "
        "predicted and observed acceptance per position beside it. Add `?position=i` for "
        "one position.\n\n"
        "The link goes to **`${avest_url}`**, the *avest HTTP* box at the top: the sidecar's "
        "admin HTTP address as your browser reaches it "
        f"(`{AVEST_URL_DEFAULT}` for the Compose stack; on Kubernetes after "
        "`kubectl -n avest port-forward svc/avest 8000`).",
        w=4,
        h=9,
    )
    return [bars, link]
