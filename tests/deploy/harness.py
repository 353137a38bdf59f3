"""Helpers for the deploy tests: external tools, a real avest service and a
real Prometheus server on loopback, PromQL taken from the dashboards and the
alert rules.

Nothing here mocks: the service is ``avest serve`` in a subprocess
(:func:`tests.support.serve.serve`), fed over gRPC with the generated stub;
Prometheus is the real server scraping it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.helpers import find_tool, free_port, http_get
from tests.support.serve import stop_process

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
PROMETHEUS_DIR = DEPLOY / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
COMPOSE = DEPLOY / "docker-compose.yml"
DATASOURCE_UID = "avest-prometheus"

#: The vLLM 0.33.0 metric names the dashboards and rules may use, as exposed
#: (counters with ``_total``), derived from the wheel's
#: vllm/v1/spec_decode/metrics.py (``SpecDecodingProm``): each has the labels
#: ``model_name`` (the served model name) and ``engine``; the per-position
#: counter adds ``position`` ("0" .. K-1). ``up`` is Prometheus's own.
VLLM_SPEC_DECODE_METRICS = frozenset(
    {
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    }
)
PROMETHEUS_BUILTIN = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})
#: The strata the live service's fed pair deals its rows among (docs/strata.md), and
#: the hardware label whose draft-length schedule is asked for (tests/deploy/conftest.py):
#: the dashboard's Strata and Draft-length schedule rows then have series.
STRATA = ("greedy", "t0.5-1")
HARDWARE = "deploy-test"


# -- external tools ------------------------------------------------------------


def require_tool(name: str, how: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(f"`{name}` not found on PATH or beside {sys.executable}: {how}")
    return path


PROMETHEUS_HINT = "install the Debian package `prometheus` (scripts/check does, as root)"


@dataclass(frozen=True)
class Fed:
    pair_id: str
    target: str
    draft: str
    k: int
    steps: int
    acked: int
    updates: int


def feed_sample_trace(
    grpc_address: str,
    workers: int = 2,
    refit_interval: int = 10,
    worker_prefix: str = "deploy-test",
    timeout: float = 60.0,
    strata: tuple[str, ...] = (),
    schedule: str | None = None,
) -> Fed:
    """Register the bundled sample trace's pair and stream every decode step of
    it as ``workers`` concurrent Observe streams (steps dealt round-robin);
    returns once every step is acknowledged. Then one refused request (a K that
    differs from the pair's) so the refusal counter moves.

    ``strata``: each step's rows are dealt round-robin among these strata, so the
    pair exports its per-stratum series. ``schedule``: a hardware label given
    cost curves, whose draft-length schedule is asked for once every step is
    acknowledged, so the pair exports its schedule's series."""
    import grpc
    import numpy as np

    from avest.offline.trace import bundled_sample_path, read_trace
    from avest_wire.messages import set_step_strata
    from avest_wire.v1 import estimator_pb2 as pb
    from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

    trace = read_trace(bundled_sample_path())
    meta = trace.meta
    key = pb.PairKey(
        target_model=str(meta["target"]),
        draft_model=str(meta["draft"]),
        method=str(meta["method"]),
        num_speculative_tokens=trace.k,
        labels={"workload": "deploy-test"},
    )
    steps = list(trace.steps())
    with grpc.insecure_channel(grpc_address) as channel:
        stub = pb_grpc.EstimatorServiceStub(channel)
        reg = stub.RegisterPair(
            pb.RegisterPairRequest(
                key=key, update_rule=pb.UPDATE_RULE_TRACKING, refit_interval=refit_interval
            ),
            timeout=10,
        )
        pair_id = reg.pair_id

        def requests(worker: int) -> Iterator[Any]:
            for seq, step in enumerate(steps[worker::workers], start=1):
                req = pb.ObserveRequest(
                    pair_id=pair_id,
                    worker_id=f"{worker_prefix}-{worker}",
                    sequence=seq,
                    features=np.ascontiguousarray(step.features, dtype="<f4").tobytes(),
                    rows=step.rows,
                    k=trace.k,
                    num_verified=step.num_verified.tolist(),
                    num_accepted=step.num_accepted.tolist(),
                )
                if strata:
                    set_step_strata(req, [strata[r % len(strata)] for r in range(step.rows)])
                yield req

        acked = [0] * workers
        updates = [0] * workers
        errors: list[BaseException] = []

        def run(worker: int) -> None:
            try:
                for resp in stub.Observe(requests(worker), timeout=timeout):
                    if resp.HasField("ack"):
                        acked[worker] = max(acked[worker], resp.ack.acked_sequence)
                    else:
                        updates[worker] += 1
            except BaseException as exc:  # reported below, in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 5)
        if errors:
            raise errors[0]
        if schedule is not None:
            # A cheap drafter and a verify pass of 5 ms plus 0.1 ms per token.
            verify = [(n, 5.0 + 0.1 * (n - 1)) for n in (1, 2, 4096)]
            stub.SetCostCurves(
                pb.SetCostCurvesRequest(
                    pair_id=pair_id,
                    hardware=schedule,
                    draft_curve=[pb.CostPoint(size=n, ms=ms) for n, ms in ((1, 0.2), (512, 0.4))],
                    verify_curve=[pb.CostPoint(size=n, ms=ms) for n, ms in verify],
                    cudagraph_capture_limit=1,
                ),
                timeout=10,
            )
            got = stub.GetSchedule(
                pb.GetScheduleRequest(pair_id=pair_id, hardware=schedule), timeout=30
            )
            assert got.ranges, got
        # One refusal: a K that is not the pair's.
        bad = pb.ObserveRequest(
            pair_id=pair_id,
            worker_id=f"{worker_prefix}-refused",
            sequence=1,
            features=np.zeros((1, trace.k + 1), dtype="<f4").tobytes(),
            rows=1,
            k=trace.k + 1,
            num_verified=[1],
            num_accepted=[0],
        )
        try:
            for _ in stub.Observe(iter([bad]), timeout=10):
                pass
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
    return Fed(
        pair_id=pair_id,
        target=key.target_model,
        draft=key.draft_model,
        k=trace.k,
        steps=len(steps),
        acked=sum(acked),
        updates=max(updates),
    )


# -- Prometheus -----------------------------------------------------------------


@dataclass
class Prometheus:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, **params: str) -> dict[str, Any]:
        """GET an API path; returns the JSON body also for 4xx answers (errors)."""
        url = f"{self.url}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            body = http_get(url, timeout=10)
        except urllib.error.HTTPError as exc:
            body = exc.read()
        return json.loads(body)

    def query(self, expr: str) -> dict[str, Any]:
        return self.api("/api/v1/query", query=expr)


def prometheus_config(avest_target: str, vllm_target: str, rules: Path) -> str:
    """deploy/prometheus/prometheus.yml made to run on loopback: 1 s scrape and
    evaluation intervals, the avest job pointed at ``avest_target``, the vLLM
    job's DNS discovery replaced by ``vllm_target``, the replicas' job (whose
    replicas are not run here) left out, the rule file by its absolute path.
    Everything else (metrics paths, relabelling) is the deploy file's own.
    Every edit must find its text, so a change in the deploy file fails here
    loudly rather than testing something else."""
    text = PROMETHEUS_CONFIG.read_text()

    def once(pattern: str, repl: str, flags: int = 0) -> None:
        nonlocal text
        text, n = re.subn(pattern, lambda _m: repl, text, flags=flags)
        if n < 1:
            raise AssertionError(f"{PROMETHEUS_CONFIG}: no match for {pattern!r}")

    # The replicas' job (the compose postgres profile): no replica runs here.
    once(r"(?m)^  - job_name: avest-replicas\n(?:    .*\n)*\n?", "")
    once(r"(?m)^(\s*)scrape_interval: \S+$", "")
    once(r"(?m)^(\s*)evaluation_interval: \S+$", "")
    once(r"(?m)^global:$", "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s")
    once(r"(?m)^  - alerts\.yml$", f"  - {json.dumps(str(rules))}")
    once(r'"avest:8000"', json.dumps(avest_target))
    once(
        r'(?m)^    dns_sd_configs:\n      - names: \["vllm"\]\n(?:        .*\n)*',
        f"    static_configs:\n      - targets: [{json.dumps(vllm_target)}]\n",
    )
    if text.count("scrape_interval") != 1 or "dns_sd_configs" in text:
        raise AssertionError(f"unexpected scrape settings left in:\n{text}")
    return text


def start_prometheus(
    binary: str, workdir: Path, config_text: str, timeout: float = 30
) -> Prometheus:
    config = workdir / "prometheus.yml"
    config.write_text(config_text)
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prom = Prometheus(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if http_get(prom.url + "/-/ready", timeout=2):
                return prom
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError(f"prometheus not ready in {timeout}s:\n{log.read_text()[-4000:]}")


# -- PromQL from the dashboards and the rules ----------------------------------

#: A metric name in PromQL: letters, digits, ``_`` and ``:`` (vLLM's ``vllm:``).
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
#: Words that are not metric names where a name could stand: aggregation
#: operators (which may precede ``by (...)``), binary and grouping keywords.
_PROMQL_KEYWORDS = frozenset(
    [
        *("sum", "min", "max", "avg", "group", "stddev", "stdvar", "count"),
        *("count_values", "bottomk", "topk", "quantile", "limitk", "limit_ratio"),
        *("by", "without", "on", "ignoring", "group_left", "group_right"),
        *("bool", "and", "or", "unless", "atan2", "offset", "inf", "nan"),
    ]
)


def strip_strings(expr: str) -> str:
    """The expression with quoted strings emptied (label values, regexes)."""
    return re.sub(r'"(?:[^"\\]|\\.)*"' + r"|'(?:[^'\\]|\\.)*'|`[^`]*`", '""', expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not keywords,
    function calls (followed by ``(``), label names (inside braces or grouping
    lists) or durations."""
    text = strip_strings(expr)
    text = re.sub(r"\{[^{}]*\}", " ", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if word.lower() in _PROMQL_KEYWORDS or text[m.end() :].lstrip().startswith("("):
            continue
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] in ".$"):
            continue  # exponent of a number (1e3), or a leftover variable
        names.add(word)
    return names


def selectors(expr: str) -> list[str]:
    """Instant-vector selectors in an expression: ``name{matchers}`` or a bare
    name, without their range (``[5m]``)."""
    out = []
    for name in sorted(metric_names(expr)):
        pattern = re.compile(
            r"(?<![A-Za-z0-9_:])" + re.escape(name) + r"(?![A-Za-z0-9_:])\s*(\{[^{}]*\})?"
        )
        for m in pattern.finditer(expr):
            out.append(name + (m.group(1) or ""))
    return sorted(set(out))


def substitute_grafana(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana's variables (``$name``, ``${name}``, ``[[name]]``) by values.
    ``$1``-style references (label_replace's capture groups) are no variables:
    Grafana leaves them as they are, and so does this."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name.isdigit():
            return m.group(0)
        if name not in values:
            raise KeyError(f"no test value for Grafana variable {name!r} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]", repl, expr)


def readmes() -> str:
    """deploy/README.md, the root README.md and the pages of docs/ together (what
    a deployment needs explained may live in any of them)."""
    pages = (DEPLOY / "README.md", REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
    return "\n".join(p.read_text() for p in pages if p.is_file())


def load_dashboards() -> dict[Path, dict[str, Any]]:
    return {p: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def iter_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels", []))


@dataclass(frozen=True)
class DashboardQuery:
    where: str
    expr: str


def dashboard_queries(dashboard: dict[str, Any]) -> list[DashboardQuery]:
    """Every PromQL expression of a dashboard: panel targets and query variables."""
    out = []
    for panel in iter_panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append(
                    DashboardQuery(
                        f"panel {panel.get('title')!r} {target.get('refId')}", target["expr"]
                    )
                )
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        if text:
            out.append(DashboardQuery(f"variable {var['name']!r}", text))
    return out


def grafana_function_to_promql(text: str) -> str:
    """Grafana's Prometheus variable functions as the PromQL they evaluate:
    ``label_values(expr, label)`` -> ``expr``, ``query_result(expr)`` -> ``expr``."""
    m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", text, re.S)
    if m:
        return m.group(1)
    m = re.fullmatch(r"\s*query_result\((.*)\)\s*", text, re.S)
    if m:
        return m.group(1)
    return text


# -- the demo's simulated vLLM counters ------------------------------------------

VLLM_SIM = DEPLOY / "demo" / "vllm_metrics_sim.py"


def start_vllm_sim(
    port: int, steps_per_second: float = 50.0, timeout: float = 20.0
) -> subprocess.Popen[str]:
    """deploy/demo/vllm_metrics_sim.py on loopback, looping over the sample trace."""
    proc = subprocess.Popen(
        [
            sys.executable,
            str(VLLM_SIM),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--steps-per-second",
            str(steps_per_second),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"vllm_metrics_sim exited {proc.returncode}:\n{out}")
        try:
            http_get(f"http://127.0.0.1:{port}/metrics", timeout=2)
            return proc
        except (OSError, urllib.error.URLError):
            time.sleep(0.1)
    stop_process(proc)
    raise RuntimeError("vllm_metrics_sim did not start serving")


def sample_names(exposition: str) -> set[str]:
    """Every sample name in a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name for fam in text_string_to_metric_families(exposition) for s in fam.samples}


def load_script(path: Path, name: str) -> ModuleType:
    """A script of the deploy tree (not a package) imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grafana_values(fed: Any) -> dict[str, str]:
    """Grafana's variables as the dashboards' queries see them for the fed pair ``fed``."""
    return {
        "job": "avest",
        "instance": ".*",
        "pair": fed.pair_id,
        "target": fed.target,
        "stratum": ".*",  # All
        "__rate_interval": "1m",
        "__interval": "15s",
        "__range": "1h",
    }
