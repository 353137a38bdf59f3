"""deploy/grafana: the provisioned dashboard is what build_dashboard.py makes,
names its datasource only through the datasource variable (which the shipped
provisioning's default datasource fills), names only metrics that avest's live
/metrics or vLLM 0.33 expose, and every query it runs works against a real
Prometheus scraping a real avest. Importing it elsewhere: test_deploy_grafana_import."""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

import pytest

from .harness import (
    DASHBOARDS,
    DATASOURCE_UID,
    DEPLOY,
    PROMETHEUS_BUILTIN,
    REPO,
    VLLM_SPEC_DECODE_METRICS,
    dashboard_queries,
    grafana_function_to_promql,
    grafana_values,
    iter_panels,
    load_dashboards,
    load_script,
    metric_names,
    readmes,
    sample_names,
    selectors,
    substitute_grafana,
)

pytestmark = pytest.mark.slow

DASHBOARD = DASHBOARDS / "avest.json"
BUILDER = DEPLOY / "grafana" / "build_dashboard.py"
PROVISIONING = DEPLOY / "grafana" / "provisioning"


def load_builder() -> Any:
    return load_script(BUILDER, "avest_build_dashboard")


@pytest.fixture(scope="module")
def dashboards() -> dict[Path, dict[str, Any]]:
    found = load_dashboards()
    assert DASHBOARD in found, f"no {DASHBOARD}"
    return found


def all_exprs(dashboards: dict[Path, dict[str, Any]]) -> list[tuple[str, str]]:
    return [
        (f"{path.name}: {q.where}", q.expr)
        for path, d in dashboards.items()
        for q in dashboard_queries(d)
    ]


def test_the_dashboard_file_is_what_build_dashboard_py_generates() -> None:
    builder = load_builder()
    assert DASHBOARD.read_text() == builder.render(), (
        "deploy/grafana/dashboards/avest.json is stale: run python deploy/grafana/build_dashboard.py"
    )


def test_the_provisioned_datasource_is_the_default_the_variable_starts_on() -> None:
    """The shipped stack provisions one Prometheus datasource, its default: the
    dashboard's datasource variable (no uid preselected) starts on it."""
    text = (PROVISIONING / "datasources" / "prometheus.yml").read_text()
    assert re.search(rf"(?m)^\s+uid:\s*{re.escape(DATASOURCE_UID)}\s*$", text)
    assert re.search(r"(?m)^\s+type:\s*prometheus\s*$", text)
    assert re.search(r"(?m)^\s+url:\s*http://prometheus:9090\s*$", text)
    assert re.search(r"(?m)^\s+isDefault:\s*true\s*$", text)
    assert load_builder().DATASOURCE == {"type": "prometheus", "uid": "${datasource}"}
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert ds["current"]["value"] == "default" and ds["regex"] == ""


def test_dashboards_are_provisioned_from_the_folder_compose_mounts() -> None:
    text = (PROVISIONING / "dashboards" / "avest.yml").read_text()
    m = re.search(r"(?m)^\s+path:\s*(\S+)\s*$", text)
    assert m, text
    compose = (DEPLOY / "docker-compose.yml").read_text()
    assert f"./grafana/dashboards:{m.group(1)}:ro" in compose
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in compose


def test_panels_are_laid_out_on_the_grid_with_unique_ids(
    dashboards: dict[Path, dict[str, Any]],
) -> None:
    for path, d in dashboards.items():
        ids = [p["id"] for p in iter_panels(d["panels"])]
        assert len(ids) == len(set(ids)), path.name
        cells: set[tuple[int, int]] = set()
        for p in iter_panels(d["panels"]):
            g = p["gridPos"]
            assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, (p["title"], g)
            for x in range(g["x"], g["x"] + g["w"]):
                for y in range(g["y"], g["y"] + g["h"]):
                    assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                    cells.add((x, y))
        titles = [p["title"] for p in iter_panels(d["panels"])]
        assert len(titles) == len(set(titles)), path.name
        assert d["uid"] and len(d["uid"]) <= 40


def test_the_pair_variable_comes_from_avest_pair_info(
    dashboards: dict[Path, dict[str, Any]],
) -> None:
    variables = {v["name"]: v for v in dashboards[DASHBOARD]["templating"]["list"]}
    pair = variables["pair"]
    assert pair["type"] == "query" and pair["hide"] == 0
    assert pair["query"]["query"].startswith("query_result(") and pair["query"]["qryType"] == 3
    assert 'avest_pair_info{job="$job",instance=~"$instance"}' in pair["query"]["query"]
    assert "(?<text>" in pair["regex"] and "(?<value>" in pair["regex"]
    assert "$" not in pair["regex"]  # Grafana interpolates variables in the regex
    # The sidecar's variables: the targets that export avest_info.
    assert variables["job"]["query"]["query"] == "label_values(avest_info, job)"
    assert (
        variables["instance"]["query"]["query"] == 'label_values(avest_info{job="$job"}, instance)'
    )
    assert variables["instance"]["includeAll"] and variables["instance"]["allValue"] == ".*"
    # The vLLM panels select the pair's target model by vLLM's model_name label.
    assert (
        variables["target"]["query"]["query"]
        == 'label_values(avest_pair_info{job="$job",instance=~"$instance",pair="$pair"}, target)'
    )
    # Every avest query selects the sidecar; every one about one pair, the pair.
    for where, expr in all_exprs(dashboards):
        for sel in selectors(grafana_function_to_promql(expr)):
            name = sel.split("{", 1)[0]
            if name.startswith("avest_") and name != "avest_info" or name == "up":
                assert 'job="$job",instance=~"$instance"' in sel, (where, sel)
        if any(
            n in expr
            for n in (
                *("avest_slope", "avest_intercept", "avest_auc", "avest_ece", "avest_log_loss"),
                *("avest_stratum_", "avest_strata_", "avest_schedule_"),
            )
        ):
            assert 'pair="$pair"' in expr, where


def test_the_panels_the_issue_asks_for_are_there(dashboards: dict[Path, dict[str, Any]]) -> None:
    exprs = "\n".join(e for _, e in all_exprs(dashboards))
    wanted = {
        "slope over time": r'avest_slope\{[^}]*pair="\$pair"\}',
        "intercepts over time": r'avest_intercept\{[^}]*pair="\$pair"\}',
        "avest predicted acceptance per position": r"avest_predicted_acceptance\{",
        "avest observed acceptance per position": r"avest_observed_acceptance\{",
        "vLLM per-position acceptance": r"rate\(vllm:spec_decode_num_accepted_tokens_per_pos_total\{"
        r'model_name="\$target"\}\[\$__rate_interval\]\)\)\s*/ on \(\) group_left '
        r"sum\(rate\(vllm:spec_decode_num_drafts_total",
        "AUC": r"avest_auc\{",
        "ECE": r"avest_ece\{",
        "log loss": r"avest_log_loss\{",
        "drafts ingested per second": r"rate\(avest_drafts_observed_total\{",
        "refit latency": r"histogram_quantile\(0\.99, sum by \(le\) \(rate\(avest_refit_duration_seconds_bucket",
        "RPC latency by method": r"histogram_quantile\(0\.99, sum by \(le, method\) \(rate\(avest_rpc_duration_seconds_bucket",
        "refused batches": r"rate\(avest_refused_batches_total\{[^}]*\}\[",
        "survival gauges": r'avest_observed_survival\{[^}]*pair="\$pair"\}',
        "reliability bins": r"max by \(bin\) \(avest_reliability_observed\{",
        # Strata (issue 31): per stratum picked, and the rows past the bound.
        "slope per stratum": r'avest_stratum_slope\{[^}]*pair="\$pair",stratum=~"\$stratum"\}',
        "ECE per stratum": r'avest_stratum_ece\{[^}]*stratum=~"\$stratum"\}',
        "log loss per stratum": r'avest_stratum_log_loss\{[^}]*stratum=~"\$stratum"\}',
        "drafts per stratum": r'avest_stratum_drafts\{[^}]*stratum=~"\$stratum"\}',
        "fallback rate": r"rate\(avest_strata_fallback_rows_total\{[^}]*\}\[",
        # The draft-length schedule (issue 32): lengths per range, goodput per choice.
        "scheduled lengths": r"by \(pair, hardware, range_start, range_end\) "
        r"\(avest_schedule_num_speculative_tokens\{",
        "goodput per choice": r"by \(pair, hardware, range_start, choice\) "
        r"\(avest_schedule_expected_goodput_tokens_per_second\{",
    }
    missing = [what for what, pattern in wanted.items() if not re.search(pattern, exprs)]
    assert not missing, missing


def test_every_panel_is_explained(dashboards: dict[Path, dict[str, Any]]) -> None:
    readme = readmes()
    for p in iter_panels(dashboards[DASHBOARD]["panels"]):
        if p["type"] == "row":
            continue
        assert len(p.get("description", "")) > 30, f"panel {p['title']!r} has no description"
        assert p["title"] in readme, f"the READMEs do not explain panel {p['title']!r}"


# -- metric names -------------------------------------------------------------------


def test_every_metric_name_is_exposed_by_avest_or_vllm(
    dashboards: dict[Path, dict[str, Any]], live_avest: Any
) -> None:
    """Names in the dashboards exist in the live service's /metrics (after a
    trace was observed) or among vLLM 0.33's spec-decode counters."""
    from avest.metrics import names as avest_metrics

    live = sample_names(live_avest.service.metrics_text())
    declared = avest_metrics.exposed_names()
    used: dict[str, str] = {}
    for where, expr in all_exprs(dashboards):
        for name in metric_names(grafana_function_to_promql(expr)):
            used.setdefault(name, where)
    assert used, "no metric names found"
    unknown = {
        name: where
        for name, where in used.items()
        if name not in live
        and name not in VLLM_SPEC_DECODE_METRICS
        and name not in PROMETHEUS_BUILTIN
    }
    assert not unknown, f"metrics neither avest nor vLLM expose: {unknown}"
    avest_used = {n for n in used if n.startswith("avest_")}
    assert avest_used <= declared, avest_used - declared
    assert {n for n in used if n.startswith("vllm:")} == VLLM_SPEC_DECODE_METRICS - {
        "vllm:spec_decode_num_draft_tokens_total"
    }


def vllm_source_files() -> dict[str, str] | None:
    """vllm/v1/spec_decode/metrics.py and vllm/v1/metrics/loggers.py from vLLM
    0.33: $AVEST_VLLM_SOURCE (wheel or source folder), else a wheel in
    .cache/vllm (scripts/check downloads it) or ../vllm_src."""
    wanted = ("vllm/v1/spec_decode/metrics.py", "vllm/v1/metrics/loggers.py")
    candidates: list[Path] = []
    if os.environ.get("AVEST_VLLM_SOURCE"):
        candidates.append(Path(os.environ["AVEST_VLLM_SOURCE"]))
    for folder in (REPO / ".cache" / "vllm", REPO.parent / "vllm_src"):
        candidates.extend(sorted(folder.glob("vllm-0.33.0-*.whl")) if folder.is_dir() else [])
    for c in candidates:
        if c.is_file() and c.suffix == ".whl":
            with zipfile.ZipFile(c) as z:
                names = set(z.namelist())
                if all(w in names for w in wanted):
                    return {w: z.read(w).decode() for w in wanted}
        elif c.is_dir():
            root = c if (c / "vllm").is_dir() else c.parent
            if all((root / w).is_file() for w in wanted):
                return {w: (root / w).read_text() for w in wanted}
    return None


def test_the_vllm_metric_names_and_labels_match_vllm_0_33_source() -> None:
    files = vllm_source_files()
    if files is None:
        pytest.skip(
            "vLLM 0.33.0 source not found: set AVEST_VLLM_SOURCE to its wheel or source folder "
            "(scripts/check downloads the wheel into .cache/vllm)"
        )
    spec = files["vllm/v1/spec_decode/metrics.py"]
    loggers = files["vllm/v1/metrics/loggers.py"]
    # prometheus_client exposes a Counter named X as X_total.
    counters = {f"{n}_total" for n in re.findall(r'"(vllm:spec_decode_[a-z_]+)"', spec)}
    assert counters >= VLLM_SPEC_DECODE_METRICS, VLLM_SPEC_DECODE_METRICS - counters
    assert re.search(r"_counter_cls\s*=\s*prometheus_client\.Counter", spec)
    assert 'pos_labelnames = labelnames + ["position"]' in spec
    assert "str(pos)" in spec  # position values "0".."K-1"
    assert 'labelnames = ["model_name", "engine"]' in loggers
    assert "served_model_name" in loggers
    # The simulator of the demo uses exactly these names and labels.
    sim = (DEPLOY / "demo" / "vllm_metrics_sim.py").read_text()
    for name in VLLM_SPEC_DECODE_METRICS:
        assert f'"{name.removesuffix("_total")}"' in sim, name
    assert 'LABELS = ["model_name", "engine"]' in sim and '[*LABELS, "position"]' in sim


# -- every query against the live Prometheus ------------------------------------------


def test_every_dashboard_query_runs_and_returns_data(
    dashboards: dict[Path, dict[str, Any]], live_prometheus: Any
) -> None:
    """Each panel query and variable query, with Grafana's variables set to the
    fed pair, parses and returns series from the real Prometheus: avest's from
    the live service, vLLM's from the demo's simulator of vLLM's counters."""
    prom = live_prometheus.prometheus
    values = grafana_values(live_prometheus.avest.fed)
    problems = []
    count = 0
    for where, raw in all_exprs(dashboards):
        expr = substitute_grafana(grafana_function_to_promql(raw), values)
        body = prom.query(expr)
        count += 1
        if body.get("status") != "success":
            problems.append(f"{where}: {body.get('errorType')}: {body.get('error')}\n  {expr}")
        elif not body["data"]["result"]:
            problems.append(f"{where}: no data\n  {expr}")
    assert count >= 30
    assert not problems, "\n".join(problems)


def test_the_running_products_match_vllms_definition(live_prometheus: Any) -> None:
    """The 'through position i' panel's series: avest's observed survival gauge
    (the running product the sidecar exports) and vLLM's accepted_per_pos /
    drafts describe the same trace (every drafted
    position was verified while it was recorded), so they agree per position;
    both come out for positions 0..K-1 only."""
    builder = load_builder()
    prom = live_prometheus.prometheus
    fed = live_prometheus.avest.fed
    values = grafana_values(fed) | {"__rate_interval": "10m"}

    def by_position(expr: str) -> dict[str, float]:
        body = prom.query(substitute_grafana(expr, values))
        assert body["status"] == "success", body
        return {s["metric"]["position"]: float(s["value"][1]) for s in body["data"]["result"]}

    through = next(
        p
        for p in iter_panels(load_dashboards()[DASHBOARD]["panels"])
        if p["title"] == "Acceptance through position i: avest vs vLLM"
    )
    exprs = {t["legendFormat"].split(" {{")[0]: t["expr"] for t in through["targets"]}
    avest = by_position(exprs["avest observed"])
    predicted = by_position(exprs["avest predicted"])
    vllm = by_position(exprs["vLLM"])
    assert exprs["vLLM"] == builder.vllm_per_position()
    assert sorted(avest) == [str(i) for i in range(fed.k)] == sorted(predicted)
    assert sorted(vllm) == sorted(avest)
    # The fed trace, counted the way vLLM's SpecDecodingStats.observe_draft does.
    from avest.offline.trace import bundled_sample_path, read_trace

    trace = read_trace(bundled_sample_path())
    drafts = int((trace.num_verified > 0).sum())
    exact = {str(i): int((trace.num_accepted > i).sum()) / drafts for i in range(fed.k)}
    for pos in avest:
        # avest's product telescopes to vLLM's ratio on this fully verified trace ...
        assert avest[pos] == pytest.approx(exact[pos], rel=1e-9), (pos, avest, exact)
        # ... and the simulator's windowed rates (partial loops of the trace) come close.
        assert vllm[pos] == pytest.approx(exact[pos], abs=0.03), (pos, vllm, exact)
    # Acceptance through position i can only fall with i.
    for curve in (avest, predicted):
        seq = [curve[str(i)] for i in range(fed.k)]
        assert all(a >= b for a, b in zip(seq, seq[1:], strict=False)), seq


def test_dashboard_json_is_plain_json_for_grafana() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert d["schemaVersion"] >= 36 and d["uid"] == load_builder().UID
    assert isinstance(d["panels"], list) and d["title"]
