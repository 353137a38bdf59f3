"""The dashboard outside avest's own stack: imported as Grafana would into a
Grafana whose Prometheus datasource has another uid (kube-prometheus-stack's is
``prometheus``), every reference resolves; its variables exist and are defined
before use; the pair picker's names, the reliability bars and the SVG link
work against the real Prometheus and the real service."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from .harness import (
    DASHBOARDS,
    DEPLOY,
    STRATA,
    grafana_function_to_promql,
    grafana_values,
    http_get,
    iter_panels,
    substitute_grafana,
)
from .kube import build

pytestmark = pytest.mark.slow

DASHBOARD = DASHBOARDS / "avest.json"
#: The kustomization whose configMapGenerator makes the dashboard's ConfigMap.
CONFIGMAP = DEPLOY / "grafana"
DS_VAR = {"type": "prometheus", "uid": "${datasource}"}
#: Variables Grafana defines itself.
BUILTIN = frozenset(
    {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__all"}
    | {"__from", "__to", "__dashboard", "__org", "__user", "timeFilter"}
)
#: ``$name``, ``${name}``, ``${name:format}``, ``[[name]]``.
VARIABLE_REF = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\$(\w+)|\[\[(\w+)\]\]")


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def variables(d: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in d["templating"]["list"]}


def walk(node: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """Every (path, value) of a JSON document, containers included."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}/{i}")


def refs(text: str) -> set[str]:
    """Grafana variables a string references (``$1``-style capture groups aside)."""
    return {
        name
        for m in VARIABLE_REF.finditer(text)
        if not (name := m.group(1) or m.group(2) or m.group(3)).isdigit()
    }


def panel(d: dict[str, Any], title: str) -> dict[str, Any]:
    return next(p for p in iter_panels(d["panels"]) if p["title"] == title)


# -- static: every reference ---------------------------------------------------------


def test_every_datasource_reference_is_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    text = DASHBOARD.read_text()
    assert "avest-prometheus" not in text, "a fixed datasource uid is left"
    assert "${DS_" not in text and "__inputs" not in dashboard
    found = 0
    for path, node in walk(dashboard):
        if isinstance(node, dict) and "datasource" in node:
            assert node["datasource"] == DS_VAR, path
            found += 1
    for panel_ in iter_panels(dashboard["panels"]):
        if panel_["type"] in ("row", "text"):
            assert "targets" not in panel_, panel_["title"]
            continue
        assert panel_.get("datasource") == DS_VAR, panel_["title"]
        assert panel_["targets"], panel_["title"]
        for t in panel_["targets"]:
            assert t.get("datasource") == DS_VAR, (panel_["title"], t["refId"])
    queries = [v for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert queries and all(v["datasource"] == DS_VAR for v in queries)
    # One datasource variable, for Prometheus, preselecting no uid.
    sources = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert [(v["name"], v["query"], v["current"]["value"]) for v in sources] == [
        ("datasource", "prometheus", "default")
    ]
    assert found >= 60


def resolve_datasource_variable(variable: dict[str, Any], datasources: list[dict[str, Any]]) -> str:
    """The value Grafana gives a datasource variable (scenes' DataSourceVariable
    and MultiValueVariable): the options are the datasources of the variable's
    type by name, plus ``default`` when the current value is ``default`` and the
    default datasource is of the type; the current value if it is an option,
    else the first option."""
    of_type = sorted(
        (ds for ds in datasources if ds["type"] == variable["query"]),
        key=lambda ds: ds["name"].lower(),
    )
    assert of_type, f"no {variable['query']} datasource"
    options = [ds["uid"] for ds in of_type]
    current = (variable.get("current") or {}).get("value")
    if current == "default" and any(ds.get("isDefault") for ds in of_type):
        options.append("default")
    return str(current) if current in options else options[0]


def datasource_settings(ref: str, datasources: list[dict[str, Any]]) -> dict[str, Any]:
    """Grafana's getInstanceSettings: ``default`` is the default datasource."""
    found = [
        ds
        for ds in datasources
        if (ds.get("isDefault") if ref == "default" else ref in (ds["uid"], ds["name"]))
    ]
    assert found, f"no datasource {ref!r} in this Grafana"
    return found[0]


@pytest.mark.parametrize(
    ("datasources", "expected"),
    [
        # kube-prometheus-stack's Grafana: uid "prometheus", the default.
        (
            [
                {"name": "Alertmanager", "uid": "alertmanager", "type": "alertmanager"},
                {
                    "name": "Prometheus",
                    "uid": "prometheus",
                    "type": "prometheus",
                    "isDefault": True,
                },
            ],
            "prometheus",
        ),
        # The default is a Prometheus datasource but not the first by name.
        (
            [
                {"name": "Archive", "uid": "P1809F7CD0C75ACF3", "type": "prometheus"},
                {"name": "Live", "uid": "live", "type": "prometheus", "isDefault": True},
            ],
            "live",
        ),
        # A Grafana whose default is another kind: the first Prometheus datasource.
        (
            [
                {"name": "Loki", "uid": "loki", "type": "loki", "isDefault": True},
                {"name": "Thanos", "uid": "thanos", "type": "prometheus"},
                {"name": "Mimir", "uid": "P4169E866C3094E38", "type": "prometheus"},
            ],
            "P4169E866C3094E38",
        ),
    ],
)
def test_imported_into_a_grafana_with_other_uids_every_reference_resolves(
    dashboard: dict[str, Any], datasources: list[dict[str, Any]], expected: str
) -> None:
    """The import as Grafana does it from a file or a ConfigMap: no inputs to
    map, the datasource variable takes the Grafana's Prometheus datasource,
    every panel, target and variable then names that datasource."""
    for copy in (dashboard, configmap_dashboard()):
        value = resolve_datasource_variable(variables(copy)["datasource"], datasources)
        imported = json.loads(json.dumps(copy).replace("${datasource}", value))
        found = set()
        for path, node in walk(imported):
            if isinstance(node, dict) and "datasource" in node:
                ds = datasource_settings(node["datasource"]["uid"], datasources)
                assert ds["type"] == "prometheus", path
                found.add(ds["uid"])
        assert found == {expected}


def configmap_dashboard() -> dict[str, Any]:
    (cm,) = build(CONFIGMAP)
    (text,) = cm["data"].values()
    return dict(json.loads(text))


def test_every_variable_referenced_exists_and_is_defined_before_use(
    dashboard: dict[str, Any],
) -> None:
    defined = variables(dashboard)
    used: dict[str, str] = {}
    for path, node in walk(dashboard):
        if isinstance(node, str):
            for name in refs(node):
                used.setdefault(name, path)
    unknown = {n: where for n, where in used.items() if n not in defined and n not in BUILTIN}
    assert not unknown, unknown
    assert {"datasource", "job", "instance", "pair", "target", "avest_url"} <= set(used)
    # Grafana resolves variables in order: each query uses only earlier ones.
    order = list(defined)
    for i, name in enumerate(order):
        var = defined[name]
        if var["type"] != "query":
            continue
        query = var["query"]["query"]
        assert refs(query) - BUILTIN <= set(order[:i]), (name, refs(query))
        assert "$" not in var["regex"], name  # Grafana interpolates the regex too


def test_calibration_is_near_the_top_and_sparse_series_hide_at_zero(
    dashboard: dict[str, Any],
) -> None:
    rows = [p for p in dashboard["panels"] if p["type"] == "row"]
    assert [r["title"] for r in rows][:2] == ["Overview", "Calibration"]
    assert rows[1]["gridPos"]["y"] <= 10
    for title in (
        "Refused batches by method and reason",
        "Failed calls by method and code",
        "Calls completed by method and code",
        "Refits by outcome",
    ):
        overrides = panel(dashboard, title)["fieldConfig"]["overrides"]
        hide = [o for o in overrides if o["matcher"]["id"] == "byValue"]
        assert hide, title
        assert hide[0]["matcher"]["options"]["reducer"] == "allIsZero"
        assert hide[0]["properties"] == [
            {"id": "custom.hideFrom", "value": {"legend": True, "tooltip": True, "viz": True}}
        ]


# -- live: the pair picker, the reliability bars, the SVG link -------------------------


def grafana_query_result_lines(result: list[dict[str, Any]]) -> list[str]:
    """Grafana's query_result() lines: ``name{k="v",...} value timestamp_ms``."""
    lines = []
    for series in result:
        labels = dict(series["metric"])
        name = labels.pop("__name__", "")
        body = ",".join(f'{k}="{v}"' for k, v in labels.items())
        lines.append(f"{name}{{{body}}} {series['value'][1]} {series['value'][0] * 1000}")
    return lines


def pick(regex: str, lines: list[str]) -> list[tuple[str, str]]:
    """(text, value) per line, by the variable's regex and its named groups."""
    assert regex.startswith("/") and regex.endswith("/")
    pattern = re.compile(regex[1:-1].replace("(?<", "(?P<"))
    out = []
    for line in lines:
        m = pattern.search(line)
        if m:
            out.append((m.group("text"), m.group("value")))
    return out


def test_the_pair_picker_shows_target_draft_and_labels(
    dashboard: dict[str, Any], live_prometheus: Any
) -> None:
    prom = live_prometheus.prometheus
    fed = live_prometheus.avest.fed
    var = variables(dashboard)["pair"]
    expr = substitute_grafana(
        grafana_function_to_promql(var["query"]["query"]), grafana_values(fed)
    )
    body = prom.query(expr)
    assert body["status"] == "success", body
    picked = pick(var["regex"], grafana_query_result_lines(body["data"]["result"]))
    assert (f"{fed.target} \u2190 {fed.draft} [workload=deploy-test]", fed.pair_id) in picked
    # One entry per pair of the sidecar (other tests may have registered more),
    # each an id of 16 hex digits named target ← draft.
    assert len(picked) == len(body["data"]["result"]) == len({v for _, v in picked})
    for text, value in picked:
        assert re.fullmatch(r"[0-9a-f]{16}", value), value
        assert " \u2190 " in text, text
    # A pair without labels: no brackets. The same expression over made-up series.
    made_up = (
        'label_replace(label_replace(label_replace(label_replace(label_replace(vector(1), "target",'
        ' "tgt", "", ""), "draft", "drf", "", ""), "labels", "", "", ""), "pair", "0123", "", ""),'
        ' "__name__", "avest_pair_info", "", "")'
    )
    selector = 'avest_pair_info{job="avest",instance=~".*"}'
    assert selector in expr
    body = prom.query(expr.replace(selector, made_up))
    assert body["status"] == "success", body
    assert pick(var["regex"], grafana_query_result_lines(body["data"]["result"])) == [
        ("tgt \u2190 drf", "0123")
    ]


def test_the_reliability_bars_and_the_svg_link(
    dashboard: dict[str, Any], live_prometheus: Any
) -> None:
    prom = live_prometheus.prometheus
    fed = live_prometheus.avest.fed
    bars = panel(dashboard, "Reliability diagram (all drafts)")
    assert bars["type"] == "barchart" and bars["options"]["xField"] == "bin"
    by_ref: dict[str, dict[str, float]] = {}
    for t in bars["targets"]:
        assert t["instant"] and t["format"] == "table"
        body = prom.query(substitute_grafana(t["expr"], grafana_values(fed)))
        assert body["status"] == "success", body
        result = body["data"]["result"]
        # One series per bin, labelled by bin alone, so Grafana's merge joins them.
        assert all(set(s["metric"]) == {"bin"} for s in result), result
        by_ref[t["refId"]] = {s["metric"]["bin"]: float(s["value"][1]) for s in result}
    bins = [str(b) for b in range(15)]
    assert all(sorted(v, key=int) == bins for v in by_ref.values()), by_ref
    drafts = by_ref["C"]
    assert sum(drafts.values()) > 0
    # Grafana's transformations, in order: drop Time, merge the three tables on bin, sort
    # the bins as numbers, back to text for the category axis, rename the values.
    steps = [
        (x["id"], x["options"].get("conversions", [{}])[0].get("destinationType"))
        for x in bars["transformations"]
    ]
    assert steps == [
        ("filterFieldsByName", None),
        ("merge", None),
        ("convertFieldType", "number"),
        ("sortBy", None),
        ("convertFieldType", "string"),
        ("organize", None),
    ]
    renamed = bars["transformations"][-1]["options"]["renameByName"]
    rows = sorted(
        ({"bin": b, **{renamed[f"Value #{r}"]: by_ref[r][b] for r in by_ref}} for b in bins),
        key=lambda row: float(row["bin"]),
    )
    assert [row["bin"] for row in rows] == bins
    for row in rows:  # a filled bin's mean prediction lies in the bin
        b = int(row["bin"])
        if row["drafts"] > 0:
            assert b / 15 <= row["mean predicted"] <= (b + 1) / 15, row
            assert 0 <= row["observed"] <= 1, row
    # The value mappings name every bin by its probability range.
    mapping = bars["fieldConfig"]["overrides"][0]["properties"][0]["value"][0]["options"]
    assert sorted(mapping, key=int) == bins and mapping["0"]["text"] == "0-7%"
    # The SVG link, as the text panel and the panel link write it, reaches the
    # live service's diagram of the pair.
    link = panel(dashboard, "Reliability diagram (SVG)")
    urls = re.findall(r"\]\(([^)]+)\)", link["options"]["content"]) + [
        x["url"] for x in bars["links"]
    ]
    assert len(urls) == 2 and len(set(urls)) == 1, urls
    url = substitute_grafana(
        urls[0], {"avest_url": live_prometheus.avest.service.http_url, "pair": fed.pair_id}
    )
    assert urllib.parse.urlparse(url).path == f"/v1/pairs/{fed.pair_id}/reliability.svg"
    svg = http_get(url, timeout=60).decode()  # the first drawing imports matplotlib
    assert svg.lstrip().startswith(("<?xml", "<svg")) and "</svg>" in svg


def test_the_configmap_is_the_dashboard() -> None:
    assert configmap_dashboard() == json.loads(DASHBOARD.read_text())
    assert (CONFIGMAP / "kustomization.yaml").is_file()


def test_the_strata_and_schedule_rows_show_the_fed_pairs(
    dashboard: dict[str, Any], live_prometheus: Any
) -> None:
    """The stratum variable lists the fed pair's strata and picks among them; the
    Strata panels give a series per stratum picked, the drafts of all strata add up
    to the pair's; the schedule table's ranges are contiguous from batch size 1, and
    the goodput panel has both choices of each range."""
    from avest.core.schedule import MIN_DRAFTS

    prom = live_prometheus.prometheus
    fed = live_prometheus.avest.fed
    values = grafana_values(fed)

    def query(expr: str, **picked: str) -> list[dict[str, Any]]:
        body = prom.query(substitute_grafana(expr, values | picked))
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    var = variables(dashboard)["stratum"]
    assert var["multi"] and var["includeAll"] and var["allValue"] == ".*"
    assert list(variables(dashboard)).index("stratum") > list(variables(dashboard)).index("pair")
    listed = query(grafana_function_to_promql(var["query"]["query"]))
    assert sorted({s["metric"]["stratum"] for s in listed}) == sorted(STRATA)

    def by_stratum(title: str, **picked: str) -> dict[str, float]:
        expr = panel(dashboard, title)["targets"][0]["expr"]
        return {s["metric"]["stratum"]: float(s["value"][1]) for s in query(expr, **picked)}

    for title in ("Slope per stratum", "ECE per stratum", "Log loss per stratum"):
        assert sorted(by_stratum(title)) == sorted(STRATA), title
        # Grafana writes one value picked as it is, several as (a|b).
        assert sorted(by_stratum(title, stratum=STRATA[0])) == [STRATA[0]], title
        assert sorted(by_stratum(title, stratum=f"({'|'.join(STRATA)})")) == sorted(STRATA)
    assert all(v > 0 for v in by_stratum("Slope per stratum").values())
    drafts = by_stratum("Drafts per stratum")
    (pooled,) = query(f'avest_calibration_drafts{{job="avest",pair="{fed.pair_id}"}}')
    # Every row of both feeds was in a stratum: the strata's drafts are the pair's.
    assert sum(drafts.values()) == float(pooled["value"][1]) >= MIN_DRAFTS
    fallback = {
        t["legendFormat"]: t["expr"]
        for t in panel(dashboard, "Strata held and fallback rows")["targets"]
    }
    assert [float(s["value"][1]) for s in query(fallback["strata held"])] == [len(STRATA)]
    assert [float(s["value"][1]) for s in query(fallback["fallback rows/s"])] == [0.0]

    table = panel(dashboard, "Scheduled drafts per batch-size range")
    assert table["type"] == "table" and table["targets"][0]["instant"]
    ranges = sorted(
        (int(s["metric"]["range_start"]), int(s["metric"]["range_end"]), float(s["value"][1]))
        for s in query(table["targets"][0]["expr"])
    )
    assert ranges and ranges[0][0] == 1
    assert all(a[1] + 1 == b[0] for a, b in zip(ranges, ranges[1:], strict=False)), ranges
    assert all(0 <= length <= fed.k for _, _, length in ranges), ranges
    goodput = panel(dashboard, "Schedule: expected goodput, scheduled vs best fixed")
    choices: dict[tuple[str, str], float] = {
        (s["metric"]["range_start"], s["metric"]["choice"]): float(s["value"][1])
        for s in query(goodput["targets"][0]["expr"])
    }
    assert set(choices) == {
        (str(start), choice) for start, _, _ in ranges for choice in ("scheduled", "best_fixed")
    }
    for start, _, _ in ranges:
        # The schedule switches only past a margin: at worst a little under the best.
        scheduled, best = choices[(str(start), "scheduled")], choices[(str(start), "best_fixed")]
        assert best > 0 and scheduled >= 0.98 * best, (start, scheduled, best)
