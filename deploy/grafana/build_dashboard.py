"""Generate deploy/grafana/dashboards/avest.json (the provisioned dashboard).

    python deploy/grafana/build_dashboard.py          # write it
    python deploy/grafana/build_dashboard.py --check  # exit 1 if it is stale

Metric names come from :mod:`avest.metrics.names` (the service's single definition)
and from vLLM 0.33's ``SpecDecodingProm``. The dashboard is portable: every
panel, target and query variable names its datasource through the ``datasource``
variable (Grafana's default Prometheus datasource unless picked otherwise), and
every avest series is selected by the ``job`` and ``instance`` variables (the
targets that export ``avest_info``), so it works as provisioned by the shipped
stack, from the Kubernetes ConfigMap, or imported by hand into any Grafana.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from avest.metrics import names as m

# The dashboard's builders live beside this file (deploy/grafana/avest_dashboard/);
# make them importable however this file is run or loaded.
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

from avest_dashboard.panels import (  # noqa: E402
    DATASOURCE,
    Layout,
    datasource_variable,
    query_variable,
    textbox_variable,
)
from avest_dashboard.queries import (  # noqa: E402
    PAIR,
    PAIR_REGEX,
    pair_names,
    vllm_acceptance_length,
    vllm_per_position,
)
from avest_dashboard.rows_calibration import AVEST_URL_DEFAULT, calibration  # noqa: E402
from avest_dashboard.rows_model import acceptance, coefficients, overview  # noqa: E402
from avest_dashboard.rows_schedule import schedule  # noqa: E402
from avest_dashboard.rows_service import ingestion, rpc  # noqa: E402
from avest_dashboard.rows_strata import strata  # noqa: E402

__all__ = [
    "DATASOURCE",
    "OUT",
    "PAIR_REGEX",
    "UID",
    "build",
    "main",
    "pair_names",
    "render",
    "variables",
    "vllm_acceptance_length",
    "vllm_per_position",
]

OUT = Path(__file__).resolve().parent / "dashboards" / "avest.json"
UID = "avest-overview"


def build() -> dict:
    lay = Layout()
    p: list[dict] = []
    rows = (overview, calibration, acceptance, coefficients, strata, schedule, ingestion, rpc)
    for add_row in rows:
        p.extend(add_row(lay))

    return {
        "annotations": {"list": []},
        "description": "avest: pooled acceptance estimates for speculative decoding in vLLM "
        "(coefficients, calibration, strata, draft-length schedule, ingestion, refits, RPC).",
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "links": [],
        "panels": p,
        "refresh": "10s",
        "schemaVersion": 39,
        "tags": ["avest", "vllm", "speculative-decoding"],
        "templating": {"list": variables()},
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "title": "avest: acceptance estimator",
        "uid": UID,
        "version": 1,
    }


def variables() -> list[dict]:
    """datasource, job, instance, pair (shown as target ← draft [labels]), the
    pair's target model (hidden, for vLLM's series), the pair's strata (any, All by
    default) and the sidecar's URL."""
    return [
        datasource_variable(),
        query_variable("job", "Job", f"label_values({m.INFO}, job)"),
        query_variable(
            "instance",
            "Instance",
            f'label_values({m.INFO}{{job="$job"}}, instance)',
            all_value=".*",
        ),
        query_variable(
            "pair", "Pair", f"query_result({pair_names()})", regex=PAIR_REGEX, query_type=3
        ),
        query_variable(
            "target",
            "Target model",
            f"label_values({m.PAIR_INFO}{{{PAIR}}}, target)",
            hide=2,
        ),
        query_variable(
            "stratum",
            "Stratum",
            f"label_values({m.STRATUM_DRAFTS}{{{PAIR}}}, stratum)",
            all_value=".*",
        ),
        textbox_variable(
            "avest_url",
            "avest HTTP",
            AVEST_URL_DEFAULT,
            "The sidecar's admin HTTP address as your browser reaches it, for the link to "
            "the pair's reliability diagram (SVG).",
        ),
    ]


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
