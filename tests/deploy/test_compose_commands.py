"""deploy/docker-compose.yml's non-GPU services, each run here as a local
process with its own entrypoint, command and environment (the ``${VAR}``
interpolations resolved from deploy/.env.example, its empty tokens given real
values), as the demo profile starts them: the sidecar (the image's
``avest serve`` with the image's ENV), the demo's ``replay`` loop and
``vllm-sim``, and Prometheus with the stack's own configuration and rules.

What compose provides and a local run cannot is rewritten, and only that
(see :func:`rewrite`): the compose host names become 127.0.0.1 and the
container ports free loopback ports, container paths become the folders their
volumes mount, the vLLM job's DNS discovery (the network alias ``vllm``) a
static target. The vLLM GPU workers are left out (a GPU and a model), and so is
Grafana (not installed here): the dashboard's queries are run against the
Prometheus instead, through its HTTP query API, as Grafana would send them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.docker import env_of, stages

from .harness import (
    COMPOSE,
    DASHBOARDS,
    DEPLOY,
    PROMETHEUS_HINT,
    REPO,
    Prometheus,
    dashboard_queries,
    free_port,
    grafana_function_to_promql,
    http_get,
    require_tool,
    substitute_grafana,
)

pytestmark = pytest.mark.slow

ENV_EXAMPLE = DEPLOY / ".env.example"
DOCKERFILE = REPO / "Dockerfile"
DASHBOARD = DASHBOARDS / "avest.json"
#: The services run here; the others and why not.
RUN = ("avest", "replay", "vllm-sim", "prometheus")
NOT_RUN = {
    "vllm-0": "a vLLM worker: needs a GPU and model weights",
    "vllm-1": "a vLLM worker: needs a GPU and model weights",
    "grafana": "Grafana is not installed here; its dashboard's queries are run against Prometheus",
    "postgres": "the postgres profile: its replicas are run by test_compose_replicas.py",
    "avest-r1": "the postgres profile: run by test_compose_replicas.py",
    "avest-r2": "the postgres profile: run by test_compose_replicas.py",
}

#: Dashboard queries allowed to return nothing in a run of a minute, each
#: because the demo, working as meant, produces no such event:
ALLOWED_EMPTY = {
    # Every call ends OK in the demo: code!="OK" selects nothing until a call fails
    # (each replay pass closes its streams cleanly). The refusals panel, by contrast,
    # has data: avest_refused_batches_total exports every method and reason at 0.
    'sum by (method, code) (rate(avest_rpc_duration_seconds_count{job="avest",instance=~".*",code!="OK"}[1m]))',
}


# -- compose, as far as these services need it ------------------------------------------


def env_example() -> dict[str, str]:
    """deploy/.env.example filled in: its settings, the empty ones (the tokens and
    Grafana's password, which compose requires) given random values as its
    ``openssl rand -hex`` lines make them."""
    values: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.fullmatch(r"([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if m:
            values[m.group(1)] = m.group(2) or secrets.token_hex(32)
    assert {"AVEST_WORKER_TOKEN", "AVEST_ADMIN_TOKEN"} <= set(values), values.keys()
    return values


_INTERPOLATION = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's interpolation of every string in a loaded compose file:
    ``${VAR}``, ``$VAR``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}``, ``${VAR?error}``, and ``$$`` for a literal ``$``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        got = env.get(name)
        if op in (":-", "-"):
            return arg if (got is None or (op == ":-" and not got)) else got
        if op in (":?", "?") and (got is None or (op == ":?" and not got)):
            raise AssertionError(f"compose would refuse to start: {name}: {arg}")
        return got or ""

    return _INTERPOLATION.sub(repl, value)


def compose_services(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    services = interpolate(yaml.safe_load(COMPOSE.read_text()), env)["services"]
    assert set(services) == set(RUN) | set(NOT_RUN), (
        "a compose service is neither run here nor listed in NOT_RUN"
    )
    return services


def image_defaults() -> dict[str, dict[str, Any]]:
    """Entrypoint, environment and working directory of the images these services
    run: avest:local from the repository's Dockerfile (its last stage); the
    official Prometheus image's entrypoint."""
    runtime = stages(DOCKERFILE)[-1]
    last = {word: rest for word, rest in runtime}
    return {
        "avest:local": {
            "entrypoint": json.loads(last["ENTRYPOINT"]),
            "env": env_of(runtime),
            "workdir": last["WORKDIR"],
        },
        "prom/prometheus": {"entrypoint": ["/bin/prometheus"], "env": {}, "workdir": "/prometheus"},
    }


# -- the local processes ----------------------------------------------------------------


@dataclass
class Local:
    """A compose service as a local process: argv, environment, working directory."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:] if self.log else ""


@dataclass
class Ports:
    grpc: int = field(default_factory=free_port)
    http: int = field(default_factory=free_port)
    vllm_sim: int = field(default_factory=free_port)
    prometheus: int = field(default_factory=free_port)


def mounts(service: dict[str, Any], tmp: Path) -> dict[str, Path]:
    """Container path -> local path, from the service's volumes: a bind mount's
    source relative to deploy/, a named volume a fresh folder."""
    out: dict[str, Path] = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (DEPLOY / source).resolve()
        else:
            out[target] = tmp / "volumes" / source
            out[target].mkdir(parents=True, exist_ok=True)
    return out


def prometheus_folder(source: Path, dest: Path, ports: Ports) -> Path:
    """A copy of deploy/prometheus (rules, tests) whose prometheus.yml names the
    local targets: ``avest:8000`` becomes the sidecar's loopback port, the
    vLLM job's DNS discovery of the alias ``vllm`` (port 8000) the simulator's
    static loopback target, and the replicas' job (postgres profile, not run
    here) is left out. Nothing else changes (intervals, paths, relabelling)."""
    shutil.copytree(source, dest)
    config = yaml.safe_load((source / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["avest"]["static_configs"] == [{"targets": ["avest:8000"]}], jobs["avest"]
    jobs["avest"]["static_configs"] = [{"targets": [f"127.0.0.1:{ports.http}"]}]
    dns = jobs["vllm"].pop("dns_sd_configs")
    assert [(d["names"], d["type"], d["port"]) for d in dns] == [(["vllm"], "A", 8000)], dns
    jobs["vllm"]["static_configs"] = [{"targets": [f"127.0.0.1:{ports.vllm_sim}"]}]
    # The postgres profile's replicas are not among the services run here.
    replicas = jobs.pop("avest-replicas")
    assert [d["names"] for d in replicas["dns_sd_configs"]] == [["avest-replicas"]], replicas
    config["scrape_configs"] = list(jobs.values())
    (dest / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    return dest


def rewrite(name: str, service: dict[str, Any], ports: Ports, tmp: Path) -> Local:
    """The service's own argv and environment (compose's entrypoint and command
    over the image's), with these substitutions and no others:

    - the compose host ``avest`` and the image's ``0.0.0.0`` binds -> 127.0.0.1,
      each container port -> a free loopback port;
    - container paths -> the local folders their volumes mount (Prometheus's
      configuration folder: a copy with the local targets, prometheus_folder);
    - the images' programs -> this machine's: ``avest`` and ``python`` from this
      venv (its bin first on PATH), Debian's ``prometheus``;
    - listeners that bind every interface in a container bind loopback here
      (vllm-sim ``--host``, Prometheus ``--web.listen-address``).
    """
    image = next(v for k, v in image_defaults().items() if service["image"].startswith(k))
    argv = list(service.get("entrypoint") or image["entrypoint"]) + list(
        service.get("command") or []
    )
    env = {**image["env"], **{k: str(v) for k, v in (service.get("environment") or {}).items()}}
    paths = mounts(service, tmp)
    if name == "prometheus":
        paths["/etc/prometheus"] = prometheus_folder(
            paths["/etc/prometheus"], tmp / "etc-prometheus", ports
        )
    addresses = {
        "0.0.0.0:50051": f"127.0.0.1:{ports.grpc}",
        "0.0.0.0:8000": f"127.0.0.1:{ports.http}",
        "avest:50051": f"127.0.0.1:{ports.grpc}",
        "avest:8000": f"127.0.0.1:{ports.http}",
    }

    def local(text: str) -> str:
        for before, after in addresses.items():
            text = text.replace(before, after)
        for target, source in sorted(paths.items(), key=lambda kv: -len(kv[0])):
            if text == target or text.startswith(target + "/"):
                return str(source) + text[len(target) :]
            text = re.sub(rf"(?<==){re.escape(target)}(?=/|$)", str(source), text)
        return text

    argv = [local(a) for a in argv]
    env = {k: local(v) for k, v in env.items()}
    programs = {"avest": str(Path(sys.executable).parent / "avest"), "python": sys.executable}
    if name == "prometheus":
        programs["/bin/prometheus"] = require_tool("prometheus", PROMETHEUS_HINT)
        argv.append(f"--web.listen-address=127.0.0.1:{ports.prometheus}")
    if name == "vllm-sim":
        argv[argv.index("--port") + 1] = str(ports.vllm_sim)
        argv += ["--host", "127.0.0.1"]
    argv[0] = programs.get(argv[0], argv[0])
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    cwd = Path(local(image["workdir"]))
    if not cwd.is_dir():
        cwd = tmp / "volumes" / name
        cwd.mkdir(parents=True, exist_ok=True)
    return Local(name, argv, env, cwd)


def start(local: Local, tmp: Path) -> Local:
    local.log = tmp / f"{local.name}.log"
    with local.log.open("wb") as out:
        local.proc = subprocess.Popen(
            local.argv,
            env={**os.environ, **local.env},
            cwd=local.cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the replay loop's children too
        )
    return local


def stop(local: Local) -> None:
    proc = local.proc
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_for(what: str, check: Any, timeout: float, *watched: Local) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for w in watched:
            if w.proc is not None and w.proc.poll() is not None and w.name != "replay":
                raise AssertionError(f"{w.name} exited {w.proc.returncode}:\n{w.output()}")
        last = check()
        if last:
            return last
        time.sleep(0.5)
    logs = "\n".join(f"--- {w.name}:\n{w.output()}" for w in watched)
    raise AssertionError(f"{what}: not within {timeout:.0f} s (last: {last!r})\n{logs}")


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


def healthcheck(avest: Local) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK (``avest health``) with the service's environment."""
    hc = next(rest for word, rest in stages(DOCKERFILE)[-1] if word == "HEALTHCHECK")
    argv = json.loads(hc.partition("CMD ")[2])
    argv[0] = str(Path(sys.executable).parent / argv[0])
    return subprocess.run(
        argv,
        env={**os.environ, **avest.env},
        cwd=avest.cwd,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


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
            if not body["data"]["result"] and expr not in ALLOWED_EMPTY:
                out[expr] = where
        return out

    # Rates need two scrapes in their window: the vLLM job scrapes every 15 s.
    deadline = time.monotonic() + 90
    while (left := missing()) and time.monotonic() < deadline:
        time.sleep(2)
    assert not left, "queries without data:\n" + "\n".join(f"{w}: {e}" for e, w in left.items())
