"""Generate deploy/grafana/dashboards/avest.json (the provisioned dashboard).

    python deploy/grafana/build_dashboard.py          # write it
    python deploy/grafana/build_dashboard.py --check  # exit 1 if it is stale

Metric names come from :mod:`avest.http.names` (the service's single definition)
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

from avest.http import metrics as m

# The dashboard's builders live beside this file (deploy/grafana/avest_dashboard/);
# make them importable however this file is run or loaded.
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from avest_dashboard.panels import DATASOURCE, Layout, query_variable  # noqa: E402
from avest_dashboard.queries import (  # noqa: E402
    MAX_POSITIONS,
    PAIR,
    survival,
    vllm_acceptance_length,
    vllm_per_position,
)
from avest_dashboard.rows_model import acceptance, calibration, coefficients, overview  # noqa: E402
from avest_dashboard.rows_service import ingestion, rpc  # noqa: E402

__all__ = [
    "DATASOURCE",
    "MAX_POSITIONS",
    "OUT",
    "UID",
    "build",
    "main",
    "render",
    "survival",
    "vllm_acceptance_length",
    "vllm_per_position",
]

OUT = Path(__file__).resolve().parent / "dashboards" / "avest.json"
UID = "avest-overview"


def build() -> dict:
    lay = Layout()
    p: list[dict] = []
    for add_row in (overview, coefficients, acceptance, calibration, ingestion, rpc):
        p.extend(add_row(lay))

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
