"""deploy/docker-compose.yml's non-GPU services, each run here as a local
process with its own entrypoint, command and environment (the ``${VAR}``
interpolations resolved from deploy/.env.example, its empty tokens given real
values), as the demo profile starts them: the sidecar (the image's
``avest serve`` with the image's ENV), the demo's ``replay`` loop and
``vllm-sim``, and Prometheus with the stack's own configuration and rules.

What compose provides and a local run cannot is rewritten, and only that
(see compose.rewrite): the compose host names become 127.0.0.1 and the
container ports free loopback ports, container paths become the folders their
volumes mount, the vLLM job's DNS discovery (the network alias ``vllm``) a
static target. The vLLM GPU workers are left out (a GPU and a model), and so is
Grafana (not installed here): the dashboard's queries are run against the
Prometheus instead, through its HTTP query API, as Grafana would send them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from avest.metrics import names as avest_names

from .compose import (
    NOT_RUN,
    RUN,
    Local,
    Ports,
    compose_services,
    env_example,
    healthcheck,
    interpolate,
    rewrite,
    start,
    stop,
    wait_for,
)
from .harness import (
    DASHBOARDS,
    PROMETHEUS_HINT,
    Prometheus,
    dashboard_queries,
    grafana_function_to_promql,
    http_get,
    require_tool,
    substitute_grafana,
)

pytestmark = pytest.mark.slow

DASHBOARD = DASHBOARDS / "avest.json"

#: Dashboard queries allowed to return nothing in a run of a minute, each
#: because the demo, working as meant, produces no such event:
ALLOWED_EMPTY = {
    # Every call ends OK in the demo: code!="OK" selects nothing until a call fails
    # (each replay pass closes its streams cleanly). The refusals panel, by contrast,
    # has data: avest_refused_batches_total exports every method and reason at 0.
    'sum by (method, code) (rate(avest_rpc_duration_seconds_count{job="avest",instance=~".*",code!="OK"}[1m]))',
}

#: Series the demo never produces: its replayed sample trace has no strata, and nobody
#: asks for the pair's draft-length schedule. Queries naming only these (and the
#: stratum variable's) may return nothing; the deploy tests' live service has both
#: (tests/deploy/conftest.py).
ABSENT_IN_DEMO = (*sorted(avest_names.STRATUM_METRICS), *avest_names.SCHEDULE_METRICS)


def allowed_empty(expr: str) -> bool:
    return expr in ALLOWED_EMPTY or any(name in expr for name in ABSENT_IN_DEMO)


# -- the stack --------------------------------------------------------------------------


@dataclass
class Stack:
    env: dict[str, str]
    ports: Ports
    services: dict[str, Local]
    prometheus: Prometheus

    def cli(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(Path(sys.executable).parent / "avest"), *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, **env},
        )

    def pairs(self) -> list[dict[str, Any]]:
        r = self.cli(
            "pairs",
            "--json",
            "--address",
            f"127.0.0.1:{self.ports.grpc}",
            AVEST_TOKEN=self.env["AVEST_WORKER_TOKEN"],
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return list(json.loads(r.stdout))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_tool("prometheus", PROMETHEUS_HINT)
    tmp = tmp_path_factory.mktemp("compose")
    env = env_example()
    services = compose_services(env)
    ports = Ports()
    locals_ = {name: rewrite(name, services[name], ports, tmp) for name in RUN}
    started: list[Local] = []
    try:
        # compose's order: replay waits for the sidecar to be healthy.
        started.append(start(locals_["avest"], tmp))
        assert services["replay"]["depends_on"]["avest"]["condition"] == "service_healthy"
        wait_for(
            "avest healthy (the image's HEALTHCHECK)",
            lambda: healthcheck(locals_["avest"]).returncode == 0,
            60,
            locals_["avest"],
        )
        for name in ("replay", "vllm-sim", "prometheus"):
            started.append(start(locals_[name], tmp))
        prom = Prometheus(
            locals_["prometheus"].proc,
            f"http://127.0.0.1:{ports.prometheus}",
            tmp / "prometheus.log",
        )  # type: ignore[arg-type]

        def ready() -> bool:
            try:
                return bool(http_get(prom.url + "/-/ready", timeout=2))
            except (OSError, urllib.error.URLError):
                return False

        wait_for("prometheus ready", ready, 60, *started)
        yield Stack(env, ports, locals_, prom)
    finally:
        for local in reversed(started):
            stop(local)


# -- the assertions ---------------------------------------------------------------------


def test_every_compose_service_is_run_here_or_listed_with_a_reason() -> None:
    services = compose_services(env_example())
    for name, reason in NOT_RUN.items():
        assert name in services and reason
    for name in RUN:
        assert "gpu" not in json.dumps(services[name].get("profiles", [])), name


def test_interpolation_resolves_what_compose_resolves() -> None:
    env = {"A": "a", "E": ""}
    assert interpolate("${A}-${E:-d}-${E-d}-${U:-u}-$A-$$(x)", env) == "a-d--u-a-$(x)"
    with pytest.raises(AssertionError, match="compose would refuse"):
        interpolate("${E:?set E}", env)
    assert interpolate("${E?set E}", env) == ""


def test_the_sidecar_runs_as_compose_configures_it_and_is_healthy(stack: Stack) -> None:
    avest = stack.services["avest"]
    assert avest.argv[1:] == ["serve"]
    assert avest.env["AVEST_WORKER_TOKEN"] == stack.env["AVEST_WORKER_TOKEN"]
    assert avest.env["AVEST_REFIT_INTERVAL"] == "100"  # .env.example leaves the default
    assert avest.env["AVEST_GRPC_ADDRESS"] == f"127.0.0.1:{stack.ports.grpc}"
    r = healthcheck(avest)
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(http_get(f"http://127.0.0.1:{stack.ports.http}/readyz"))
    # The tokens are in force: without one, the pairs are refused.
    r = stack.cli("pairs", "--address", f"127.0.0.1:{stack.ports.grpc}", AVEST_TOKEN="")
    assert r.returncode != 0 and "UNAUTHENTICATED" in r.stdout + r.stderr, r.stdout + r.stderr


def test_replay_delivers_the_bundled_trace_to_the_sidecar(stack: Stack) -> None:
    from avest.offline.trace import bundled_sample_path, read_trace

    meta = read_trace(bundled_sample_path()).meta
    replay = stack.services["replay"]
    assert replay.argv[:2] == ["/bin/sh", "-c"]
    assert f"--address 127.0.0.1:{stack.ports.grpc}" in replay.argv[2]
    assert '--run-id "loop-$(date +%s)"' in replay.argv[2]  # compose's $$ is a literal $

    def learned() -> list[dict[str, Any]]:
        return [p for p in stack.pairs() if p["steps_observed"] > 0 and p["version"] > 0]

    pairs = wait_for("replay's steps observed and refitted", learned, 60, replay)
    (pair,) = pairs
    assert pair["key"]["target"] == meta["target"] and pair["key"]["k"] == 5
    assert pair["refit_interval"] == 10 and pair["drafts_observed"] > 0
    assert "UNAUTHENTICATED" not in replay.output(), replay.output()
    # The image's read port, published by compose, serves the same pair to a worker.
    from avest_client import EstimatorClient

    read = f"127.0.0.1:{stack.ports.read}"
    assert stack.services["avest"].env["AVEST_READ_ADDRESS"] == read
    token = stack.env["AVEST_WORKER_TOKEN"]
    with EstimatorClient(read, token=token, timeout=10) as client:
        assert client.coefficients(pair["pair_id"]).version > 0


def test_prometheus_scrapes_the_sidecar_and_the_simulator_with_the_compose_config(
    stack: Stack,
) -> None:
    prom = stack.prometheus
    argv = stack.services["prometheus"].argv
    assert any(a.startswith("--storage.tsdb.retention.time=15d") for a in argv)

    def targets() -> dict[str, dict[str, Any]]:
        body = prom.api("/api/v1/targets")
        active = {t["labels"]["job"]: t for t in body["data"]["activeTargets"]}
        return (
            active if all(t["health"] == "up" for t in active.values()) and len(active) == 2 else {}
        )

    active = wait_for("both scrape targets up", targets, 60, *stack.services.values())
    assert active["avest"]["scrapeUrl"] == f"http://127.0.0.1:{stack.ports.http}/metrics"
    assert active["avest"]["lastError"] == "" and active["vllm"]["lastError"] == ""
    assert prom.query("avest_info")["data"]["result"]
    # vLLM's names as vLLM documents them (the config's relabelling).
    assert wait_for(
        "vLLM's counters stored",
        lambda: prom.query("vllm:spec_decode_num_drafts_total")["data"]["result"],
        60,
    )
    rules = prom.api("/api/v1/rules")["data"]["groups"]
    assert {g["name"] for g in rules} >= {"avest-sidecar", "avest-estimates"}
    assert all(r["health"] != "err" for g in rules for r in g["rules"])


def test_every_dashboard_query_returns_data_from_that_prometheus(stack: Stack) -> None:
    """Each panel target and variable query of the dashboard, with Grafana's
    variables set to the replayed pair, returns series from the Prometheus that
    scrapes the compose services (except ALLOWED_EMPTY, each justified there)."""
    pair = wait_for("a pair", lambda: stack.pairs(), 60, stack.services["replay"])[0]
    values = {
        "job": "avest",
        "instance": ".*",
        "pair": pair["pair_id"],
        "target": pair["key"]["target"],
        "stratum": ".*",  # All
        "__rate_interval": "1m",  # 4 x the 15 s vLLM scrape interval, as Grafana takes it
        "__interval": "15s",
        "__range": "1h",
    }
    exprs = {
        substitute_grafana(grafana_function_to_promql(q.expr), values): q.where
        for q in dashboard_queries(json.loads(DASHBOARD.read_text()))
    }
    assert len(exprs) >= 30
    assert set(exprs) >= ALLOWED_EMPTY, ALLOWED_EMPTY - set(exprs)

    def missing() -> dict[str, str]:
        out = {}
        for expr, where in exprs.items():
            body = stack.prometheus.query(expr)
            if body.get("status") != "success":
                raise AssertionError(f"{where}: {body.get('error')}\n  {expr}")
            if not body["data"]["result"] and not allowed_empty(expr):
                out[expr] = where
        return out

    # Rates need two scrapes in their window: the vLLM job scrapes every 15 s.
    deadline = time.monotonic() + 90
    while (left := missing()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not left, "queries without data:\n" + "\n".join(f"{w}: {e}" for e, w in left.items())
