"""deploy/docker-compose.yml's ``postgres`` profile run as local processes, as
test_compose_commands.py runs the demo profile: the two avest replicas
(``avest-r1``, ``avest-r2``), each with its own entrypoint, command and
environment (``${VAR}`` resolved from deploy/.env.example), started together on
one real PostgreSQL database, and Prometheus with the stack's own
configuration scraping them through its replicas job.

What compose provides and a local run cannot is rewritten, and only that:
ports and hosts as compose.rewrite rewrites them; the image's
``/data`` volume (an anonymous one per container) a fresh folder per replica;
in the store URL, the ``postgres`` service's host, port and database the test
cluster's (the user is the same, ``avest``; the cluster trusts loopback, so the
password goes unused); and the replicas job's DNS discovery of the network
alias ``avest-replicas`` one static target per replica. The ``postgres``
service itself is the test cluster (its health check is run against a real
server in test_deploy_replicas.py); the SQLite sidecar, the vLLM workers and
Grafana are test_compose_commands.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.support.helpers import http_get
from tests.support.postgres import PostgresCluster
from tests.support.serve import stop_process

from .compose import (
    Local,
    Ports,
    compose_services,
    env_example,
    healthcheck,
    rewrite,
    start,
    stop,
    wait_for,
)
from .harness import (
    ALERTS,
    PROMETHEUS_CONFIG,
    PROMETHEUS_HINT,
    Prometheus,
    require_tool,
    start_prometheus,
)

pytestmark = pytest.mark.slow

#: The profile's replicas, as compose names them.
REPLICAS = ("avest-r1", "avest-r2")
#: The job and network alias through which Prometheus finds the replicas.
REPLICAS_JOB = "avest-replicas"
#: Seconds a replica may take to start and load the pairs on a loaded machine.
START_S = 120
#: Seconds until Prometheus has scraped both (the job scrapes every 5 s).
SCRAPE_S = 120
#: This checkout's CLI, as the image's ``avest``.
AVEST = str(Path(sys.executable).parent / "avest")


@dataclass
class Replica:
    local: Local
    ports: Ports

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.ports.http}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports.grpc}"


@dataclass
class Replicas:
    env: dict[str, str]
    database: str
    replicas: dict[str, Replica]
    prometheus: Prometheus


def local_store(compose_url: str, cluster_url: str) -> str:
    """The compose store URL with the service ``postgres:5432/avest`` swapped
    for the test cluster's host, port and database; user and password kept."""
    url, cluster = urlsplit(compose_url), urlsplit(cluster_url)
    assert (url.scheme, url.hostname, url.port, url.path) == (
        "postgresql",
        "postgres",
        5432,
        "/avest",
    )
    assert url.username == cluster.username, "the cluster's role is the compose database's user"
    netloc = f"{url.username}:{url.password}@{cluster.hostname}:{cluster.port}"
    return url._replace(netloc=netloc, path=cluster.path).geturl()


def replica(name: str, service: dict[str, Any], cluster_url: str, tmp: Path) -> Replica:
    ports = Ports()
    local = rewrite(name, service, ports, tmp)
    local.env["AVEST_STORE"] = local_store(local.env["AVEST_STORE"], cluster_url)
    # The image's VOLUME /data: an anonymous volume of each container.
    assert local.env["AVEST_DATA_DIR"] == "/data" and not service.get("volumes")
    data = tmp / name / "data"
    data.mkdir(parents=True)
    local.env["AVEST_DATA_DIR"] = str(data)
    local.cwd = data
    return Replica(local, ports)


def prometheus_config(replicas: dict[str, Replica]) -> str:
    """deploy/prometheus/prometheus.yml with its replicas job only, its DNS
    discovery made one static target per replica, the rules by absolute path.
    Intervals, paths and the rest of the job are the file's own."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == REPLICAS_JOB]
    (sd,) = job.pop("dns_sd_configs")
    assert sd["names"] == [REPLICAS_JOB] and sd["port"] == 8000, sd
    job["static_configs"] = [{"targets": [r.http for r in replicas.values()]}]
    config["scrape_configs"] = [job]
    assert config["rule_files"] == ["alerts.yml"]
    config["rule_files"] = [str(ALERTS)]
    return str(yaml.safe_dump(config, sort_keys=False))


def ready(r: Replica) -> bool:
    try:
        return bool(json.loads(http_get(f"http://{r.http}/readyz", timeout=5)))
    except (OSError, urllib.error.URLError, ValueError):
        return False


@pytest.fixture(scope="module")
def replicas(
    postgres_cluster: PostgresCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Replicas]:
    binary = require_tool("prometheus", PROMETHEUS_HINT)
    tmp = tmp_path_factory.mktemp("compose-replicas")
    env = env_example()
    services = compose_services(env)
    database = postgres_cluster.create_database()
    started: list[Local] = []
    prom: Prometheus | None = None
    try:
        reps = {name: replica(name, services[name], database, tmp) for name in REPLICAS}
        # Together, as compose starts them once the database is healthy.
        for name in REPLICAS:
            assert services[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
            started.append(start(reps[name].local, tmp))
        for r in reps.values():
            wait_for(f"{r.local.name} ready", lambda r=r: ready(r), START_S, *started)
        workdir = tmp / "prometheus"
        workdir.mkdir()
        prom = start_prometheus(binary, workdir, prometheus_config(reps))
        yield Replicas(env, database, reps, prom)
    finally:
        if prom is not None:
            stop_process(prom.proc)
        for local in reversed(started):
            stop(local)


def test_each_replica_runs_as_compose_configures_it_on_the_shared_database(
    replicas: Replicas,
) -> None:
    urls = set()
    for name, r in replicas.replicas.items():
        local = r.local
        assert local.argv[1:] == ["serve"]
        assert local.env["AVEST_REPLICA_NAME"] == name
        assert local.env["AVEST_WORKER_TOKEN"] == replicas.env["AVEST_WORKER_TOKEN"]
        urls.add(urlsplit(local.env["AVEST_STORE"])._replace(netloc="").geturl())
        # The image's HEALTHCHECK passes, and the replica is ready.
        hc = healthcheck(local)
        assert hc.returncode == 0, hc.stdout + hc.stderr
        assert ready(r)
    assert urls == {urlsplit(replicas.database)._replace(netloc="").geturl()}


def test_prometheus_scrapes_each_replica_as_a_target_of_its_own(replicas: Replicas) -> None:
    prom = replicas.prometheus

    def targets() -> dict[str, dict[str, Any]]:
        active = prom.api("/api/v1/targets")["data"]["activeTargets"]
        up = {t["scrapeUrl"]: t for t in active if t["labels"]["job"] == REPLICAS_JOB}
        return up if len(up) == 2 and all(t["health"] == "up" for t in up.values()) else {}

    locals_ = [r.local for r in replicas.replicas.values()]
    active = wait_for("both replicas scraped", targets, SCRAPE_S, *locals_)
    assert set(active) == {f"http://{r.http}/metrics" for r in replicas.replicas.values()}

    def instances() -> list[dict[str, Any]]:
        result = prom.query(f'count by (instance) (avest_info{{job="{REPLICAS_JOB}"}})')
        found = result["data"]["result"]
        return found if len(found) == 2 else []

    found = wait_for("avest_info from both replicas", instances, SCRAPE_S, *locals_)
    assert {s["metric"]["instance"] for s in found} == {r.http for r in replicas.replicas.values()}


def test_a_pair_fed_through_one_replica_is_served_by_the_other(replicas: Replicas) -> None:
    """The demo's workers' way in (``avest replay``) through ``avest-r1``; the
    pair and its refitted coefficients are then listed by ``avest-r2``: one
    database, two replicas."""
    first, second = (replicas.replicas[name] for name in REPLICAS)
    env = {**os.environ, "AVEST_TOKEN": replicas.env["AVEST_WORKER_TOKEN"]}

    def avest(*args: str) -> str:
        r = subprocess.run(
            [AVEST, *args], capture_output=True, text=True, timeout=300, check=False, env=env
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    fed = avest("replay", "--address", first.grpc, "--workers", "2", "--rate", "0",
                "--refit-interval", "10", "--json")  # fmt: skip
    out = json.loads(fed.strip().splitlines()[-1])

    def listed() -> list[dict[str, Any]]:
        pairs = json.loads(avest("pairs", "--json", "--address", second.grpc))
        # Acknowledged once in the pending log: refitted (version > 0) soon after.
        return [p for p in pairs if p["pair_id"] == out["pair_id"] and p["version"] > 0]

    (pair,) = wait_for("the pair listed by the other replica", listed, START_S, second.local)
    assert pair["key"] == out["key"] and pair["version"] > 0
    # Each replica's log names it (AVEST_REPLICA_NAME).
    for name, r in replicas.replicas.items():
        assert name in r.local.output(), name
