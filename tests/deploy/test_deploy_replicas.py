"""avest as replicas on one PostgreSQL: deploy/kubernetes/replicas as ``kubectl
kustomize`` renders it (its objects are validated against the Kubernetes
schemas with the other kustomizations, in test_deploy_kubernetes.py) and the
compose file's ``postgres`` profile as ``docker compose config`` resolves it.

Checked here: the Deployment takes the SQLite StatefulSet's place and keeps its
posture, the disruption budget, the Service and the ServiceMonitor reach every
replica and nothing else, the store's Secret, the demo PostgreSQL and the URL
the replicas get agree with each other, the compose replicas share one
PostgreSQL under names of their own while the default stack stays as it is,
the PostgreSQL health check answers for a real server, and Prometheus's
replicas job finds the compose replicas."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from tests.support.docker import env_of as image_env
from tests.support.docker import stages
from tests.support.helpers import free_port
from tests.support.postgres import PostgresCluster

from .compose import COMPOSE_ENV, compose_config
from .harness import COMPOSE, DEPLOY, PROMETHEUS_CONFIG, REPO, readmes
from .kube import KUBERNETES, Doc, build, env_of, load_docs, pod_spec

pytestmark = pytest.mark.slow

BASE = KUBERNETES / "base"
REPLICAS = KUBERNETES / "replicas"
STORE_SECRET = "avest-store"
TOKEN_SECRET = "avest-tokens"
#: Replicas the overlay runs: one may be down (the disruption budget) while
#: two still share the workers.
REPLICA_COUNT = 3
#: The compose profile's replicas and its database service.
COMPOSE_REPLICAS = ("avest-r1", "avest-r2")
COMPOSE_POSTGRES = "postgres"
#: What the postgres profile adds to every other profile's services.
POSTGRES_PROFILE = {COMPOSE_POSTGRES, *COMPOSE_REPLICAS}
#: A value for the profile's one setting of its own (deploy/.env.example).
POSTGRES_ENV = {**COMPOSE_ENV, "AVEST_POSTGRES_PASSWORD": "postgres-password-for-tests"}
#: The name both compose replicas answer to, for workers and Prometheus.
REPLICAS_ALIAS = "avest-replicas"


# -- reading the rendered overlay ------------------------------------------------------


def named(docs: list[Doc], kind: str, name: str) -> Doc:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod_labels(doc: Doc) -> dict[str, str]:
    return dict(doc["spec"]["template"]["metadata"]["labels"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def only_container(doc: Doc) -> Doc:
    spec = pod_spec(doc)
    assert spec is not None, doc["kind"]
    (c,) = spec["containers"]
    return dict(c)


def overlay() -> list[Doc]:
    return build(REPLICAS)


def deployment() -> Doc:
    return named(overlay(), "Deployment", "avest")


def postgres() -> tuple[Doc, Doc]:
    """The demo PostgreSQL: its StatefulSet and its Service."""
    docs = overlay()
    sts = [d for d in docs if d["kind"] == "StatefulSet"]
    assert len(sts) == 1, [d["metadata"]["name"] for d in sts]
    (svc,) = [
        s
        for s in docs
        if s["kind"] == "Service" and selects(s["spec"]["selector"], pod_labels(sts[0]))
    ]
    return sts[0], svc


def example_secret(path: Path, name: str) -> dict[str, str]:
    (secret,) = load_docs(path)
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == name
    return dict(secret["stringData"])


def secret_ref(env: dict[str, Doc], name: str) -> tuple[str, str]:
    ref = env[name]["valueFrom"]["secretKeyRef"]
    assert ref.get("optional") is not True, f"{name}: the pod must not start without it"
    return ref["name"], ref["key"]


def exec_argv(probe: Doc) -> list[str]:
    return list(probe["exec"]["command"])


def option(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- Kubernetes: the Deployment ------------------------------------------------------


def test_the_overlay_runs_a_deployment_in_place_of_the_sqlite_statefulset() -> None:
    docs = overlay()
    assert not [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "avest"]
    assert not [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    dep = deployment()
    assert dep["spec"]["replicas"] == REPLICA_COUNT
    assert selects(dep["spec"]["selector"]["matchLabels"], pod_labels(dep))
    # Everything else of the base comes through unchanged: Service,
    # ServiceMonitor, PrometheusRule, the dashboard's ConfigMap.
    base = [d for d in build(BASE) if d["kind"] != "StatefulSet"]
    assert base
    for doc in base:
        assert doc in docs, f"{doc['kind']}/{doc['metadata']['name']} changed in the overlay"


def test_the_deployment_keeps_the_sidecars_image_probes_and_security() -> None:
    (sts,) = [d for d in build(BASE) if d["kind"] == "StatefulSet"]
    dep = deployment()
    c, base_c = only_container(dep), only_container(sts)
    for key in (
        "image",
        "ports",
        "readinessProbe",
        "livenessProbe",
        "startupProbe",
        "resources",
        "securityContext",
    ):
        assert c[key] == base_c[key], key
    spec, base_spec = pod_spec(dep), pod_spec(sts)
    assert spec is not None and base_spec is not None
    for key in (
        "securityContext",
        "terminationGracePeriodSeconds",
        "automountServiceAccountToken",
        "enableServiceLinks",
    ):
        assert spec[key] == base_spec[key], key
    # The base's settings and tokens, each the same.
    env = env_of(c)
    for name, entry in env_of(base_c).items():
        assert env[name] == entry, name
    # The data directory is an emptyDir: the pairs are in PostgreSQL.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert "emptyDir" in volumes[mounts[env["AVEST_DATA_DIR"]["value"]]]
    assert "/tmp" in mounts
    assert "volumeClaimTemplates" not in dep["spec"]


def test_an_update_never_runs_fewer_ready_replicas() -> None:
    strategy = deployment()["spec"]["strategy"]
    assert strategy["type"] == "RollingUpdate"
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0
    assert strategy["rollingUpdate"]["maxSurge"] >= 1


def test_each_replica_is_named_after_its_pod_and_reads_the_store_from_the_secret() -> None:
    env = env_of(only_container(deployment()))
    assert env["AVEST_REPLICA_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    store = example_secret(REPLICAS / "secret.example.yaml", STORE_SECRET)
    name, key = secret_ref(env, "AVEST_STORE")
    assert name == STORE_SECRET and key in store
    tokens = example_secret(KUBERNETES / "secret.example.yaml", TOKEN_SECRET)
    for var in ("AVEST_WORKER_TOKEN", "AVEST_ADMIN_TOKEN"):
        name, key = secret_ref(env, var)
        assert name == TOKEN_SECRET and key in tokens, var


def test_the_replicas_settings_are_avest_settings() -> None:
    """Every AVEST_* variable a replica gets is an ``avest serve`` setting or
    one of the token settings (as in the base)."""
    from avest.settings import Settings, env_name

    known = {env_name(f) for f in Settings.model_fields}
    known |= {"AVEST_WORKER_TOKEN", "AVEST_ADMIN_TOKEN"}
    names = set(env_of(only_container(deployment())))
    assert {"AVEST_STORE", "AVEST_REPLICA_NAME"} <= names
    assert names <= known, names - known


def test_the_disruption_budget_lets_one_replica_down_and_covers_only_the_replicas() -> None:
    docs = overlay()
    dep = deployment()
    sts, _ = postgres()
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels(dep))
    assert not selects(selector, pod_labels(sts))
    # Two replicas are left while one is down.
    assert dep["spec"]["replicas"] - pdb["spec"]["maxUnavailable"] >= 2


def test_replicas_prefer_different_nodes_without_requiring_them() -> None:
    dep = deployment()
    spec = pod_spec(dep)
    assert spec is not None
    anti = spec["affinity"]["podAntiAffinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] > 0
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["podAffinityTerm"]["labelSelector"]["matchLabels"], pod_labels(dep))


def test_the_service_and_the_servicemonitor_reach_every_replica_and_not_the_database() -> None:
    """The ServiceMonitor scrapes every endpoint of the Services it selects:
    the avest Service, whose endpoints are the Deployment's pods, each its own
    target. The database's Service is neither selected nor scraped."""
    docs = overlay()
    dep = deployment()
    sts, pg_svc = postgres()
    svc = named(docs, "Service", "avest")
    assert selects(svc["spec"]["selector"], pod_labels(dep))
    assert not selects(svc["spec"]["selector"], pod_labels(sts))
    (sm,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    sm_selector = sm["spec"]["selector"]["matchLabels"]
    assert selects(sm_selector, svc["metadata"]["labels"])
    assert not selects(sm_selector, pg_svc["metadata"]["labels"])
    assert "namespaceSelector" not in sm["spec"]  # the overlay's own namespace
    container_ports = {p["name"] for p in only_container(dep)["ports"]}
    targets = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert targets[ep["port"]] in container_ports


# -- Kubernetes: the store -----------------------------------------------------------


def test_the_example_store_url_names_the_demo_postgres() -> None:
    """The URL the replicas get (avest-store's ``url``) names the demo
    PostgreSQL's Service and port, the user and database it creates, and the
    password it is given from the same Secret."""
    sts, svc = postgres()
    store = example_secret(REPLICAS / "secret.example.yaml", STORE_SECRET)
    url = urlsplit(store["url"])
    assert url.scheme == "postgresql"
    assert url.hostname == svc["metadata"]["name"]
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == url.port]
    container = only_container(sts)
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    env = env_of(container)
    assert url.username == env["POSTGRES_USER"]["value"]
    assert url.path.lstrip("/") == env["POSTGRES_DB"]["value"]
    name, key = secret_ref(env, "POSTGRES_PASSWORD")
    assert name == STORE_SECRET and unquote(url.password or "") == store[key]


def test_the_demo_postgres_is_postgresql_15_with_its_own_volume() -> None:
    sts, svc = postgres()
    assert sts["spec"]["replicas"] == 1
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert selects(sts["spec"]["selector"]["matchLabels"], pod_labels(sts))
    c = only_container(sts)
    assert c["image"] == "postgres:15"
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    pgdata = Path(env_of(c)["PGDATA"]["value"])
    # A folder inside the claim (its root may hold lost+found, which initdb refuses).
    assert pgdata.parent == Path(mounts[claim["metadata"]["name"]])
    # Said where an operator looks: a demo, production uses its own PostgreSQL.
    assert re.search(r"(?i)production", (REPLICAS / "postgres.yaml").read_text())
    assert re.search(r"(?i)production", (REPLICAS / "kustomization.yaml").read_text())


def test_the_demo_postgres_runs_unprivileged_on_a_read_only_root() -> None:
    sts, _ = postgres()
    spec = pod_spec(sts)
    assert spec is not None
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True
    assert pod_sc["runAsUser"] == pod_sc["fsGroup"] != 0
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    c = only_container(sts)
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    # Where the server writes outside its data: the socket folder and /tmp.
    mounted = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/var/run/postgresql", "/tmp"} <= mounted
    assert set(c["resources"]["requests"]) == {"cpu", "memory"}
    assert "memory" in c["resources"]["limits"]


def test_the_demo_postgres_is_ready_only_once_it_answers_over_tcp() -> None:
    sts, _ = postgres()
    c = only_container(sts)
    env = env_of(c)
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        argv = exec_argv(c[probe])
        assert argv[0] == "pg_isready", probe
        assert option(argv, "-h") == "127.0.0.1", probe
        assert option(argv, "-U") == env["POSTGRES_USER"]["value"], probe
        assert option(argv, "-d") == env["POSTGRES_DB"]["value"], probe


def server_settings(argv: list[str]) -> dict[str, str]:
    """The ``-c name=value`` settings of a PostgreSQL command line."""
    assert len([a for a in argv if a == "-c"]) * 2 == len(argv), argv
    pairs = [argv[i + 1].split("=", 1) for i in range(0, len(argv), 2) if argv[i] == "-c"]
    return {name: value for name, value in pairs}


def demo_server_settings() -> tuple[dict[str, str], dict[str, str]]:
    """The demo PostgreSQL's settings: on Kubernetes (the container's args, after
    the image's ``postgres``) and in compose (its command)."""
    sts, _ = postgres()
    kube = server_settings(only_container(sts)["args"])
    command = postgres_profile()["services"][COMPOSE_POSTGRES]["command"]
    assert command[0] == "postgres"
    return kube, server_settings(command[1:])


def test_the_demo_postgres_finds_a_vanished_replicas_connection_dead_within_seconds() -> None:
    """A replica refits a pair while its session holds the pair's lock; the
    server ends a session whose client vanished (node lost, network cut) once
    keepalives find it dead. Both demo databases say so, alike, within 30 s."""
    kube, compose = demo_server_settings()
    assert kube == compose
    idle, interval, count = (
        int(kube[f"tcp_keepalives_{k}"]) for k in ("idle", "interval", "count")
    )
    assert idle + interval * count <= 30
    assert int(kube["tcp_user_timeout"]) <= 30_000  # milliseconds


def test_the_demo_postgres_settings_are_accepted_by_postgresql(
    postgres_cluster: PostgresCluster,
) -> None:
    """Each setting names a real PostgreSQL parameter and a value it takes (set
    on a session of a real server: these are all per-session settings)."""
    import psycopg

    kube, _ = demo_server_settings()
    with psycopg.connect(postgres_cluster.url("postgres"), autocommit=True) as conn:
        for name, value in kube.items():
            conn.execute(f"SET {name} = {value}")
            assert conn.execute(f"SHOW {name}").fetchone(), name


def test_the_overlay_sets_the_same_sidecar_image_as_the_base() -> None:
    base = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    over = yaml.safe_load((REPLICAS / "kustomization.yaml").read_text())
    images = {i["name"]: i for i in over["images"]}
    (base_image,) = base["images"]
    assert images["avest"] == base_image


# -- compose: the postgres profile -----------------------------------------------------


def postgres_profile(env: dict[str, str] | None = None) -> dict[str, Any]:
    return compose_config("postgres", env={**POSTGRES_ENV, **(env or {})})


def test_the_postgres_profile_adds_a_database_and_two_replicas_and_leaves_the_rest() -> None:
    default = compose_config()
    cfg = postgres_profile()
    assert set(cfg["services"]) == set(default["services"]) | POSTGRES_PROFILE
    for name, service in default["services"].items():
        assert cfg["services"][name] == service, name
    # The default sidecar stays on SQLite, with its volume.
    avest = default["services"]["avest"]
    assert "AVEST_STORE" not in avest["environment"]
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in avest["volumes"])
    # And no other profile brings the replicas in.
    for profiles in (("demo",), ("gpu", "gpu-2")):
        assert not POSTGRES_PROFILE & set(compose_config(*profiles)["services"]), profiles


def test_the_compose_replicas_share_one_postgres_under_names_of_their_own() -> None:
    cfg = postgres_profile()["services"]
    pg_env = cfg[COMPOSE_POSTGRES]["environment"]
    avest = cfg["avest"]
    names = set()
    for name in COMPOSE_REPLICAS:
        r = cfg[name]
        env = r["environment"]
        url = urlsplit(env["AVEST_STORE"])
        assert url.scheme == "postgresql" and url.hostname == COMPOSE_POSTGRES and url.port == 5432
        assert url.username == pg_env["POSTGRES_USER"]
        assert url.path.lstrip("/") == pg_env["POSTGRES_DB"]
        assert (
            url.password == pg_env["POSTGRES_PASSWORD"] == POSTGRES_ENV["AVEST_POSTGRES_PASSWORD"]
        )
        assert env["AVEST_REPLICA_NAME"] == name
        names.add(env["AVEST_REPLICA_NAME"])
        # The sidecar's image, settings and tokens.
        assert r["image"] == avest["image"] and r["build"] == avest["build"]
        for key, value in avest["environment"].items():
            assert env[key] == value, (name, key)
        assert r["depends_on"][COMPOSE_POSTGRES]["condition"] == "service_healthy"
        assert REPLICAS_ALIAS in r["networks"]["default"]["aliases"]
        assert {p["target"] for p in r["ports"]} == {50051, 50052, 8000}
    assert len(names) == len(COMPOSE_REPLICAS)
    first, second = (cfg[n]["environment"] for n in COMPOSE_REPLICAS)
    assert {k: v for k, v in first.items() if k != "AVEST_REPLICA_NAME"} == {
        k: v for k, v in second.items() if k != "AVEST_REPLICA_NAME"
    }


def test_the_postgres_profile_publishes_on_loopback_only_and_on_ports_of_its_own() -> None:
    every = compose_config("demo", "gpu", "gpu-2", "postgres", env=POSTGRES_ENV)["services"]
    published: dict[str, str] = {}
    for name, service in every.items():
        for port in service.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", (name, port)
            assert port["published"] not in published, (name, published)
            published[port["published"]] = name
    assert not every[COMPOSE_POSTGRES].get("ports"), "the database stays inside compose's network"


def test_the_postgres_service_is_postgresql_15_checked_over_tcp_with_a_volume() -> None:
    pg = postgres_profile()["services"][COMPOSE_POSTGRES]
    assert pg["image"] == "postgres:15"
    test = pg["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "pg_isready"
    argv = test[1:]
    assert option(argv, "-h") == "127.0.0.1"
    assert option(argv, "-U") == pg["environment"]["POSTGRES_USER"]
    assert option(argv, "-d") == pg["environment"]["POSTGRES_DB"]
    (volume,) = pg["volumes"]
    assert volume["type"] == "volume" and volume["target"] == "/var/lib/postgresql/data"


def test_the_postgres_password_has_no_default() -> None:
    """Left empty, the database gets no password, which the postgres image
    refuses (it will not create the database): no password is made up. And
    the default stack does not need it."""
    cfg = postgres_profile({"AVEST_POSTGRES_PASSWORD": ""})["services"]
    assert cfg[COMPOSE_POSTGRES]["environment"]["POSTGRES_PASSWORD"] == ""
    assert not re.search(r"AVEST_POSTGRES_PASSWORD:?-[^}]", COMPOSE.read_text())
    example = (DEPLOY / ".env.example").read_text()
    assert re.search(r"(?m)^AVEST_POSTGRES_PASSWORD=$", example)
    compose_config()  # COMPOSE_ENV has no AVEST_POSTGRES_PASSWORD


def test_the_postgres_health_check_answers_for_a_running_server(
    postgres_cluster: PostgresCluster,
) -> None:
    """The compose health check's own command line, with the port of a real
    PostgreSQL added (compose's runs inside the container, on 5432): ready
    while the server listens, not ready where none does."""
    pg = postgres_profile()["services"][COMPOSE_POSTGRES]
    argv = pg["healthcheck"]["test"][1:]
    beside = postgres_cluster.bindir / "pg_isready"
    program = str(beside) if beside.is_file() else shutil.which("pg_isready")
    assert program, "pg_isready ships with initdb and pg_ctl"

    def check(port: int) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [program, *argv[1:], "-p", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    ready = check(postgres_cluster.port)
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert check(free_port()).returncode != 0


def test_prometheus_finds_every_compose_replica_by_their_shared_name() -> None:
    cfg = postgres_profile()["services"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    job = jobs[REPLICAS_ALIAS]
    (sd,) = job["dns_sd_configs"]
    assert sd["names"] == [REPLICAS_ALIAS] and sd["type"] == "A"
    # The port each replica serves /metrics on in its container: the image's
    # AVEST_HTTP_ADDRESS, which the replicas keep.
    http = image_env(stages(REPO / "Dockerfile")[-1])["AVEST_HTTP_ADDRESS"]
    for name in COMPOSE_REPLICAS:
        assert "AVEST_HTTP_ADDRESS" not in cfg[name]["environment"]
    assert sd["port"] == int(http.rsplit(":", 1)[1])
    assert job["metrics_path"] == jobs["avest"]["metrics_path"] == "/metrics"
    assert job["scrape_interval"] == jobs["avest"]["scrape_interval"]


# -- the documentation -------------------------------------------------------------------


def test_the_replicas_are_documented() -> None:
    text = readmes()
    for needle in (
        "Replicas on PostgreSQL",
        "deploy/kubernetes/replicas",
        "--profile postgres",
        "avest-store",
        "AVEST_REPLICA_NAME",
        "AVEST_POSTGRES_PASSWORD",
        "avest-replicas",
        "PodDisruptionBudget",
    ):
        assert needle in text, needle
    # The files are in the README's tables.
    table = (DEPLOY / "README.md").read_text()
    assert "`replicas/`" in table or "`deploy/kubernetes/replicas/`" in table
