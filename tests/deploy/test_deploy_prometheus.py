"""deploy/prometheus: promtool's checks, the alert rules loaded by a real
Prometheus scraping a real avest, every rule expression evaluated there, and
unit tests of each alert's firing logic with ``promtool test rules``."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from .harness import (
    ALERTS,
    PROMETHEUS_DIR,
    PROMETHEUS_HINT,
    VLLM_SPEC_DECODE_METRICS,
    metric_names,
    readmes,
    require_tool,
    selectors,
)

pytestmark = pytest.mark.slow

# The alerts the issue asks for, by what they watch.
EXPECTED_ALERTS = {
    "AvestSidecarDown",  # sidecar down (up == 0)
    "AvestSidecarMissing",
    "AvestBatchesRefused",  # refused batches
    "AvestObserveStreamsFailing",  # streams failing: workers drop while disconnected
    "AvestObserveBacklog",
    "AvestOverloaded",  # backpressure: streams held back by a full pair queue, sustained
    "AvestEventLoopSaturated",  # the event loop's p99 lag past 0.5 s, sustained
    "AvestCalibrationDrift",  # ECE above a threshold, sustained
    "AvestAcceptanceDivergence",  # predicted vs observed acceptance
    "AvestPairNoObservations",  # a registered pair without observations
    "AvestRefitsFailing",  # rejected / slope_held rate
    "AvestRefitsRejected",
    "AvestStrataFallback",  # rows of a stratum past the bound on strata, sustained
}


def promtool() -> str:
    return require_tool("promtool", PROMETHEUS_HINT)


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_promtool_check_config() -> None:
    r = run([promtool(), "check", "config", "prometheus.yml"], cwd=PROMETHEUS_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr


def test_promtool_check_rules() -> None:
    r = run([promtool(), "check", "rules", str(ALERTS)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(EXPECTED_ALERTS)} rules found" in r.stdout + r.stderr


# -- against the live Prometheus -------------------------------------------------


def loaded_rules(live_prometheus: Any) -> list[dict[str, Any]]:
    """The rules of alerts.yml as the live Prometheus loaded them, once each has
    been evaluated at least once."""
    prom = live_prometheus.prometheus
    deadline = time.monotonic() + 15
    while True:
        body = prom.api("/api/v1/rules")
        assert body["status"] == "success", body
        rules = [r for g in body["data"]["groups"] for r in g["rules"]]
        evaluated = all(not r.get("lastEvaluation", "0001").startswith("0001") for r in rules)
        if (rules and evaluated) or time.monotonic() > deadline:
            return rules
        time.sleep(0.25)


def test_the_live_prometheus_loads_every_alert_and_evaluates_it_without_error(
    live_prometheus: Any,
) -> None:
    rules = loaded_rules(live_prometheus)
    assert {r["name"] for r in rules} == EXPECTED_ALERTS
    for r in rules:
        assert r["type"] == "alerting", r
        assert r["health"] == "ok", (r["name"], r.get("lastError"))
        assert not r.get("lastError"), (r["name"], r["lastError"])
        assert r["labels"].get("severity") in {"critical", "warning"}, r["name"]
        ann = r["annotations"]
        assert ann.get("summary", "").strip(), f"{r['name']} has no summary"
        assert len(ann.get("description", "").strip()) > 40, f"{r['name']} has no description"


def test_every_alert_expression_parses_and_its_avest_series_exist(live_prometheus: Any) -> None:
    """Each rule's expression runs without error against Prometheus; every
    avest series it selects (with its label matchers) has data there, so a rule
    cannot stay silent because of a misspelt metric or label."""
    prom = live_prometheus.prometheus
    with ALERTS.open() as f:
        text = f.read()
    rules = loaded_rules(live_prometheus)
    assert len(rules) == len(EXPECTED_ALERTS)
    problems = []
    for r in rules:
        expr = r["query"]
        body = prom.query(expr)
        if body.get("status") != "success":
            problems.append(f"{r['name']}: {body.get('error')}")
            continue
        for sel in selectors(expr):
            name = sel.split("{")[0]
            if not name.startswith("avest_"):
                continue
            got = prom.query(sel)
            if got.get("status") != "success" or not got["data"]["result"]:
                problems.append(f"{r['name']}: no data for {sel}")
    assert not problems, "\n".join(problems)
    # Every metric an alert names is avest's, vLLM's, or Prometheus's own.
    for r in rules:
        for name in metric_names(r["query"]):
            assert name.startswith("avest_") or name in VLLM_SPEC_DECODE_METRICS or name == "up", (
                r["name"],
                name,
            )
    assert "avest_" in text


def test_the_sidecar_is_recognised_by_avest_info_and_not_down(live_prometheus: Any) -> None:
    """The down alert's right-hand side finds the live sidecar's target (and
    only it: not the vLLM job), and its expression is empty while it is up."""
    prom = live_prometheus.prometheus
    body = prom.query("up and on (job, instance) max_over_time(avest_info[1d])")
    assert [(s["metric"]["job"], s["value"][1]) for s in body["data"]["result"]] == [("avest", "1")]
    rules = {r["name"]: r for r in loaded_rules(live_prometheus)}
    assert prom.query(rules["AvestSidecarDown"]["query"])["data"]["result"] == []
    assert prom.query(rules["AvestSidecarMissing"]["query"])["data"]["result"] == []


# -- unit tests of the alert logic (promtool test rules) -----------------------------

ALERTS_TEST = PROMETHEUS_DIR / "alerts_test.yml"


def test_the_unit_cases_cover_every_alert() -> None:
    """alerts_test.yml has, for every alert, a time it fires and a time it
    does not; and its series are labelled as a ServiceMonitor labels them."""
    doc = yaml.safe_load(ALERTS_TEST.read_text())
    assert doc["rule_files"] == ["alerts.yml"]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in doc["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check["exp_alerts"] else silent).add(check["alertname"])
    assert firing == EXPECTED_ALERTS, EXPECTED_ALERTS ^ firing
    assert silent == EXPECTED_ALERTS, EXPECTED_ALERTS ^ silent
    jobs = {
        m.group(1)
        for case in doc["tests"]
        for series in case["input_series"]
        if (m := re.search(r'\bjob="([^"]*)"', series["series"]))
    }
    assert "avest-sidecar" in jobs, jobs


def test_alert_logic_with_promtool_test_rules() -> None:
    """``promtool test rules alerts_test.yml``: every alert against
    deploy/prometheus/alerts.yml itself, annotations included."""
    r = run([promtool(), "test", "rules", ALERTS_TEST.name], cwd=PROMETHEUS_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_no_alert_names_a_scrape_job() -> None:
    """The rules select avest by its metrics, never by ``job``: nothing in
    them matches on a job's name."""
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    for rule in rules:
        assert not re.search(r"\bjob\s*=~?", rule["expr"]), (rule["alert"], rule["expr"])


def test_alerts_test_catches_rules_tied_to_job_avest(tmp_path: Path) -> None:
    """The unit tests would catch the old ``up{job="avest"}`` selectors: with
    them put back, promtool fails on the ServiceMonitor-named cases."""
    text = ALERTS.read_text()
    old = text.replace(
        "up == 0 and on (job, instance) max_over_time(avest_info[1d])", 'up{job="avest"} == 0'
    ).replace("absent(avest_info)", 'absent(up{job="avest"})')
    assert old != text
    (tmp_path / "alerts.yml").write_text(old)
    (tmp_path / "alerts_test.yml").write_text(ALERTS_TEST.read_text())
    r = run([promtool(), "test", "rules", "alerts_test.yml"], cwd=tmp_path)
    assert r.returncode != 0, r.stdout
    assert "AvestSidecarDown" in r.stdout + r.stderr
    assert "AvestSidecarMissing" in r.stdout + r.stderr


SERIES = 'job="avest", instance="avest:8000"'
#: The labels a per-pair alert keeps of SERIES: it aggregates away those that
#: name one replica (instance, pod), for a pair's series move at a fail-over.
BASE = {"job": "avest"}


def alert(name: str, severity: str = "warning", **labels: str) -> dict[str, Any]:
    return {"exp_labels": {"alertname": name, "severity": severity, **labels}}


def test_alert_annotations_render(live_prometheus: Any, tmp_path: Path) -> None:
    """The annotation templates of alerts.yml render for a firing alert: the
    ones named in ``RENDERED`` are checked verbatim through promtool."""
    rules = {r["name"]: r for r in loaded_rules(live_prometheus)}
    r = rules["AvestCalibrationDrift"]
    group = {
        "name": "avest",
        "rules": [
            {
                "alert": r["name"],
                "expr": r["query"],
                "for": f"{int(r['duration'])}s",
                "labels": r["labels"],
                "annotations": {"summary": r["annotations"]["summary"]},
            }
        ],
    }
    rule_file = tmp_path / "rules.json"
    rule_file.write_text(json.dumps({"groups": [group]}))
    test = {
        "rule_files": [str(rule_file)],
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {"series": f'avest_recent_ece{{{SERIES}, pair="p"}}', "values": "0.08x40"},
                    {
                        "series": f'avest_calibration_drafts{{{SERIES}, pair="p"}}',
                        "values": "20000x40",
                    },
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "35m",
                        "alertname": "AvestCalibrationDrift",
                        "exp_alerts": [
                            {
                                "exp_labels": alert("AvestCalibrationDrift", **BASE, pair="p")[
                                    "exp_labels"
                                ],
                                "exp_annotations": {
                                    "summary": "avest pair p is miscalibrated (recent ECE 8%)"
                                },
                            }
                        ],
                    }
                ],
            }
        ],
    }
    test_file = tmp_path / "rules_test.json"
    test_file.write_text(json.dumps(test))
    out = run([promtool(), "test", "rules", str(test_file)])
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_each_alert_is_documented_in_the_deploy_readme(name: str) -> None:
    assert name in readmes(), f"neither deploy/README.md nor README.md explains {name}"
