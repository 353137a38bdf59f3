"""The "Strata" row (docs/strata.md): each stratum's served slope and calibration
beside the pair's, its drafts, and the rows that fell back to the pair's
coefficients past the bound on strata."""

from __future__ import annotations

from avest.metrics import names as m
from avest_wire.strata import MAX_STRATA

from .panels import Layout, dashed, refs, row, target, timeseries
from .queries import ECE_THRESHOLD, RI, pair, pair_gauge, stratum_gauge

#: The pair's own series drawn beside its strata's, dashed.
PAIRS_OWN = "pair (all strata)"
#: The count of strata held, as steps on a right axis up to the bound.
STRATA_AXIS = {
    "matcher": {"id": "byName", "options": "strata held"},
    "properties": [
        {"id": "unit", "value": "short"},
        {"id": "custom.axisPlacement", "value": "right"},
        {"id": "custom.lineInterpolation", "value": "stepAfter"},
        {"id": "min", "value": 0},
        {"id": "max", "value": MAX_STRATA},
        {"id": "decimals", "value": 0},
    ],
}


def per_stratum(
    lay: Layout,
    title: str,
    description: str,
    stratum: str,
    pooled: str,
    minimum: float | None = None,
    threshold: float | None = None,
    decimals: int | None = 3,
) -> dict:
    """A per-stratum gauge (one line per stratum picked), a third of the row wide,
    with the pair's own measure dashed."""
    return timeseries(
        lay,
        title,
        description,
        refs((stratum_gauge(stratum), "{{stratum}}"), (pair_gauge(pooled), PAIRS_OWN)),
        unit="none",
        w=8,
        minimum=minimum,
        threshold=threshold,
        decimals=decimals,
        overrides=[dashed(PAIRS_OWN)],
    )


def strata(lay: Layout) -> list[dict]:
    """The "Strata" row and its panels; empty for a pair that never saw a stratum."""
    return [
        row(lay, "Strata"),
        per_stratum(
            lay,
            "Slope per stratum",
            "Served slope of each stratum picked in the stratum variable (its own fit shrunk "
            "toward the pair's, the shrinkage fading as its drafts grow), and the pair's own "
            "slope (dashed), which workers without strata use. Strata whose slopes sit apart "
            "are kinds of request one coefficient set would miscalibrate. Empty for a pair "
            "without strata.",
            m.STRATUM_SLOPE,
            m.SLOPE,
            minimum=0,
        ),
        per_stratum(
            lay,
            "ECE per stratum",
            "Expected calibration error (15 bins) of what each stratum served, over its drafts "
            "since it was placed, and the pair's over all its drafts (dashed). The pair's "
            "measure pools the strata, whose errors can cancel: calibration per stratum is "
            "judged here. Dashed red line: the AvestCalibrationDrift threshold.",
            m.STRATUM_ECE,
            m.ECE,
            minimum=0,
            threshold=ECE_THRESHOLD,
        ),
        per_stratum(
            lay,
            "Log loss per stratum",
            "Mean log loss (nats per draft, lower is better) of what each stratum served, "
            "since it was placed, and the pair's over all its drafts (dashed).",
            m.STRATUM_LOG_LOSS,
            m.LOG_LOSS,
        ),
        timeseries(
            lay,
            "Drafts per stratum",
            "Labelled drafts of each stratum picked since it was placed. A stratum without "
            "drafts for 50 of the pair's refits is retired and its series ends.",
            [target(stratum_gauge(m.STRATUM_DRAFTS), "{{stratum}}")],
        ),
        timeseries(
            lay,
            "Strata held and fallback rows",
            f"Strata the pair holds (right axis; at most {MAX_STRATA}) and rows per second "
            "predicted with the pair's coefficients because their stratum found no place "
            f"({m.STRATA_FALLBACK_ROWS}). Fallback rows lose their stratum's calibration: "
            "fewer temperature buckets or operator labels keep every stratum in (alert "
            "AvestStrataFallback).",
            refs(
                (f"sum(rate({pair(m.STRATA_FALLBACK_ROWS)}[{RI}]))", "fallback rows/s"),
                (f"count(max by (pair, stratum) ({pair(m.STRATUM_DRAFTS)}))", "strata held"),
            ),
            unit="ops",
            overrides=[STRATA_AXIS],
        ),
    ]
