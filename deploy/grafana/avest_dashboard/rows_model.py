"""Rows about the pair's model: Overview, Coefficients, Acceptance."""

from __future__ import annotations

from avest.core.estimator import DEFAULT_RECENT_DECAY
from avest.metrics import names as m

from .panels import DATASOURCE, Layout, dashed, refs, row, stat, target, timeseries
from .queries import (
    RI,
    VLLM_ACCEPTED,
    VLLM_ACCEPTED_PER_POS,
    VLLM_DRAFTS,
    pair,
    pair_gauge,
    sidecar,
    vllm_acceptance_length,
    vllm_per_position,
)


def overview(lay: Layout) -> list[dict]:
    """The "Overview" row: the sidecar's scrape, the pair's counters, the pair's key."""
    return [
        row(lay, "Overview"),
        stat(
            lay,
            "Sidecar",
            "Prometheus's scrape of the avest admin HTTP port (the job and instance "
            "picked above): UP or DOWN. Alert AvestSidecarDown fires after a minute down.",
            sidecar("up"),
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
        ),
        *(
            stat(lay, title, description, expr, unit=unit)
            for title, description, expr, unit in COUNTERS
        ),
        pair_table(lay),
    ]


#: The Overview's stat panels after the scrape: (title, description, query, unit).
COUNTERS = (
    (
        "Pairs",
        "Model pairs registered with (or restored by) the sidecar; on replicas each "
        "exports the pairs it refits, and the sum is the pairs they hold.",
        f"sum({sidecar(m.PAIRS)})",
        "short",
    ),
    (
        "Coefficients version",
        "Version of the pair's coefficients in force: +1 per applied refit; what every "
        "worker of the pair is pushed.",
        pair_gauge(m.COEFFICIENTS_VERSION),
        "short",
    ),
    (
        "Refit rounds",
        "Refit rounds closed for the pair (applied or not); one round per refit "
        "interval of observed steps pooled over all workers.",
        pair_gauge(m.ROUND),
        "short",
    ),
    (
        "Drafts ingested",
        "Verified drafts per second folded into the pair's estimator, all workers together.",
        f"sum(rate({pair(m.DRAFTS_OBSERVED)}[{RI}]))",
        "ops",
    ),
    (
        "Open streams",
        "Open Observe and WatchCoefficients streams: roughly one per connected vLLM "
        "worker (rank 0 of each tensor-parallel group), summed over the replicas.",
        f"sum({sidecar(m.OPEN_STREAMS)})",
        "short",
    ),
)


def pair_table(lay: Layout) -> dict:
    """The selected pair's key as a one-row table of avest_pair_info's labels."""
    return {
        "datasource": DATASOURCE,
        "description": "The selected pair's key (avest_pair_info): target and draft model, "
        "speculative method, K, update rule and workload labels.",
        "fieldConfig": {"defaults": {}, "overrides": []},
        "gridPos": lay.place(24, 3),
        "id": lay.id(),
        "options": {"showHeader": True, "cellHeight": "sm"},
        "targets": [
            target(
                pair_gauge(m.PAIR_INFO, "target", "draft", "method", "k", "rule", "labels"),
                "__auto",
                instant=True,
            )
        ],
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


def coefficients(lay: Layout) -> list[dict]:
    """The "Coefficients" row and its panels."""
    return [
        row(lay, "Coefficients"),
        timeseries(
            lay,
            "Slope",
            "Shared slope w of the pair's logistic model p_i = sigmoid(w * x + b_i), x the "
            "draft's logit(q_max). Steps mark refits; a flat line while drafts flow means "
            "refits are held or rejected (see Refits by outcome).",
            [target(pair_gauge(m.SLOPE), "slope")],
        ),
        timeseries(
            lay,
            "Intercepts by position",
            "Per-position intercepts b_i of the coefficients in force (position 0 is the "
            "first draft token).",
            [target(pair_gauge(m.INTERCEPT, "position"), "b{{position}}")],
        ),
    ]


def predicted_vs_observed(
    lay: Layout, title: str, description: str, predicted: str, observed: str
) -> dict:
    """avest's mean predicted acceptance (solid) and the observed rate (dashed), per position."""
    return timeseries(
        lay,
        title,
        description,
        refs(
            (pair_gauge(predicted, "position"), "predicted {{position}}"),
            (pair_gauge(observed, "position"), "observed {{position}}"),
        ),
        unit="percentunit",
        minimum=0,
        maximum=1,
        overrides=[dashed("observed.*")],
    )


def acceptance(lay: Layout) -> list[dict]:
    """The "Acceptance" row and its panels."""
    return [
        row(lay, "Acceptance"),
        predicted_vs_observed(
            lay,
            "Acceptance per position: predicted vs observed (avest)",
            "For drafts whose position was verified: avest's mean predicted acceptance "
            "probability (solid) and the observed acceptance rate (dashed), per position, "
            "cumulative since the pair was registered or reset. Calibrated estimates "
            "put each pair of lines together.",
            m.PREDICTED_ACCEPTANCE,
            m.OBSERVED_ACCEPTANCE,
        ),
        predicted_vs_observed(
            lay,
            "Recent acceptance per position: predicted vs observed (avest)",
            "The same over recent drafts only: each refit round down-weights older drafts "
            f"by {DEFAULT_RECENT_DECAY:g} (a window of about 20 rounds), so a workload shift shows here within "
            "a few thousand steps while the cumulative panel beside it barely moves. "
            "Alert AvestAcceptanceDivergence watches these.",
            m.RECENT_PREDICTED_ACCEPTANCE,
            m.RECENT_OBSERVED_ACCEPTANCE,
        ),
        timeseries(
            lay,
            "Acceptance through position i: avest vs vLLM",
            "Probability that drafts 0..i are all accepted. avest predicted / observed: "
            f"{m.PREDICTED_SURVIVAL} / {m.OBSERVED_SURVIVAL}, the running products of its "
            "per-position rates, exported by the sidecar (cumulative). vLLM: "
            f"rate({VLLM_ACCEPTED_PER_POS}) / rate({VLLM_DRAFTS}) for model_name = the "
            "pair's target (vLLM's own counters, over the rate window). With adaptive "
            "verification vLLM counts positions the budget did not verify as not "
            "accepted, so its curve can sit below avest's at late positions.",
            refs(
                (pair_gauge(m.PREDICTED_SURVIVAL, "position"), "avest predicted {{position}}"),
                (pair_gauge(m.OBSERVED_SURVIVAL, "position"), "avest observed {{position}}"),
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
        ),
        timeseries(
            lay,
            "Mean acceptance length (tokens per verification, incl. bonus)",
            "1 + expected accepted drafts per verification. avest: 1 + the sum over "
            f"positions of {m.PREDICTED_SURVIVAL} and {m.OBSERVED_SURVIVAL} (the "
            "'through position i' curves). vLLM: 1 + "
            f"rate({VLLM_ACCEPTED}) / rate({VLLM_DRAFTS}), vLLM's own definition.",
            refs(
                (
                    f"1 + sum by (pair) ({pair_gauge(m.PREDICTED_SURVIVAL, 'position')})",
                    "avest predicted",
                ),
                (
                    f"1 + sum by (pair) ({pair_gauge(m.OBSERVED_SURVIVAL, 'position')})",
                    "avest observed",
                ),
                (vllm_acceptance_length(), "vLLM"),
            ),
            overrides=[dashed("avest observed")],
        ),
    ]
