"""The "Draft-length schedule" row: per hardware label, the drafts per request the
pair's last computed schedule runs in each batch-size range, and the expected
goodput of that choice against the best fixed length."""

from __future__ import annotations

from avest.metrics import names as m

from .panels import DATASOURCE, Layout, dashed, row, target, timeseries
from .queries import pair

#: The goodput panel's legend: one line per label, range and choice.
GOODPUT_LEGEND = "{{hardware}} from {{range_start}}: {{choice}}"


def schedule(lay: Layout) -> list[dict]:
    """The "Draft-length schedule" row; empty until the pair's schedule is asked for
    (GetSchedule, GET /v1/pairs/{id}/schedule, ``avest schedule``)."""
    return [
        row(lay, "Draft-length schedule"),
        lengths(lay),
        timeseries(
            lay,
            "Schedule: expected goodput, scheduled vs best fixed",
            "Expected goodput (tokens per second, at each range's first batch size) of what "
            "the pair's last computed draft-length schedule runs there (solid) and of the best "
            "fixed length without adaptive verification, speculation off included (dashed), "
            "per hardware label and range, from the calibrated survival curves and the "
            "label's cost curves. The schedule switches only past a margin, so its line can "
            "sit a little under the best fixed one. Empty until a schedule is asked for.",
            [
                target(
                    f"max by (pair, hardware, range_start, choice) ({pair(m.SCHEDULE_GOODPUT)})",
                    GOODPUT_LEGEND,
                )
            ],
            unit="short",
            w=14,
            h=8,
            minimum=0,
            overrides=[dashed(".*best_fixed")],
        ),
    ]


def lengths(lay: Layout) -> dict:
    """The schedule as a table: one row per hardware label and batch-size range."""
    return {
        "datasource": DATASOURCE,
        "description": "The pair's last computed draft-length schedule, per hardware label "
        "(cost curves) and batch-size range (first and last batch size, requests per step; "
        "the last range governs every larger batch): the drafts per request to run there, "
        "0 turning speculation off. This is the list vLLM's "
        "speculative_config.num_speculative_tokens_per_batch_size takes (avest schedule "
        "prints it). Empty until a schedule is asked for.",
        "fieldConfig": {
            "defaults": {"decimals": 0},
            "overrides": [
                {
                    "matcher": {"id": "byName", "options": "Value"},
                    "properties": [{"id": "displayName", "value": "drafts per request"}],
                }
            ],
        },
        "gridPos": lay.place(10, 8),
        "id": lay.id(),
        "options": {"showHeader": True, "cellHeight": "sm"},
        "targets": [
            target(
                f"max by (pair, hardware, range_start, range_end) ({pair(m.SCHEDULE_LENGTH)})",
                "__auto",
                instant=True,
            )
        ],
        "title": "Scheduled drafts per batch-size range",
        "transformations": [
            {
                "id": "organize",
                "options": {
                    "excludeByName": {"Time": True, "pair": True},
                    "indexByName": {"hardware": 0, "range_start": 1, "range_end": 2, "Value": 3},
                    "renameByName": {"range_start": "from batch", "range_end": "to batch"},
                },
            },
            # Batch sizes sort as numbers ("16" sorts before "2" as text).
            {
                "id": "convertFieldType",
                "options": {
                    "conversions": [
                        {"targetField": "from batch", "destinationType": "number"},
                        {"targetField": "to batch", "destinationType": "number"},
                    ],
                    "fields": {},
                },
            },
            {
                "id": "sortBy",
                "options": {"fields": {}, "sort": [{"field": "from batch", "desc": False}]},
            },
        ],
        "type": "table",
    }
