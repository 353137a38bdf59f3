"""Rows about the pair's model: Overview, Coefficients, Acceptance."""

from __future__ import annotations

from avest.core.estimator import DEFAULT_RECENT_DECAY
from avest.http import metrics as m
from avest.http.names import TRACKING_WEIGHT

from .panels import DATASOURCE, Layout, dashed, refs, row, stat, target, timeseries
from .queries import (
    PAIR,
    RI,
    VLLM_ACCEPTED,
    VLLM_ACCEPTED_PER_POS,
    VLLM_DRAFTS,
    pair,
    sidecar,
    vllm_acceptance_length,
    vllm_per_position,
)


def overview(lay: Layout) -> list[dict]:
    """The "Overview" row and its panels."""
    p: list[dict] = []

    p.append(row(lay, "Overview"))
    p.append(
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
        )
    )
    p.append(
        stat(
            lay,
            "Pairs",
            "Model pairs registered with (or restored by) the sidecar.",
            sidecar(m.PAIRS),
        )
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
            sidecar(m.OPEN_STREAMS),
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
    return p


def coefficients(lay: Layout) -> list[dict]:
    """The "Coefficients" row and its panels."""
    p: list[dict] = []

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
    p.append(
        timeseries(
            lay,
            "Default rule: tracking weight",
            "The tracking trajectory's weight in the served coefficients; vLLM's own rule, "
            "run beside it on the same sums, has the rest. Near 1 while the carried "
            "information predicts better (stationary traffic); at 0.2 or below while the "
            "workload moves faster than tracking follows. Empty for pairs on another rule.",
            [target(f"{TRACKING_WEIGHT}{{{PAIR}}}", "tracking")],
            minimum=0.0,
            maximum=1.0,
        )
    )
    return p


def acceptance(lay: Layout) -> list[dict]:
    """The "Acceptance" row and its panels."""
    p: list[dict] = []

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
            f"{m.PREDICTED_SURVIVAL} / {m.OBSERVED_SURVIVAL}, the running products of its "
            "per-position rates, exported by the sidecar (cumulative). vLLM: "
            f"rate({VLLM_ACCEPTED_PER_POS}) / rate({VLLM_DRAFTS}) for model_name = the "
            "pair's target (vLLM's own counters, over the rate window). With adaptive "
            "verification vLLM counts positions the budget did not verify as not "
            "accepted, so its curve can sit below avest's at late positions.",
            refs(
                (pair(m.PREDICTED_SURVIVAL), "avest predicted {{position}}"),
                (pair(m.OBSERVED_SURVIVAL), "avest observed {{position}}"),
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
            "1 + expected accepted drafts per verification. avest: 1 + the sum over "
            f"positions of {m.PREDICTED_SURVIVAL} and {m.OBSERVED_SURVIVAL} (the "
            "'through position i' curves). vLLM: 1 + "
            f"rate({VLLM_ACCEPTED}) / rate({VLLM_DRAFTS}), vLLM's own definition.",
            refs(
                (f"1 + sum by (pair) ({pair(m.PREDICTED_SURVIVAL)})", "avest predicted"),
                (f"1 + sum by (pair) ({pair(m.OBSERVED_SURVIVAL)})", "avest observed"),
                (vllm_acceptance_length(), "vLLM"),
            ),
            overrides=[dashed("avest observed")],
        )
    )
    return p
