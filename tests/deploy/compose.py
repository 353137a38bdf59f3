"""deploy/docker-compose.yml for the deploy tests: its configuration as
``docker compose config`` resolves it (:func:`compose_config`), and its non-GPU
services as local processes (:func:`rewrite`, :func:`start`), each with its own
entrypoint, command and environment (the ``${VAR}`` interpolations resolved
from deploy/.env.example, its empty tokens given real values).

What compose provides and a local run cannot is rewritten, and only that: the
compose host names become 127.0.0.1 and the container ports free loopback
ports, container paths become the folders their volumes mount, the vLLM job's
DNS discovery (the network alias ``vllm``) a static target.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.docker import COMPOSE_HINT, compose_command, env_of, stages

from .harness import COMPOSE, DEPLOY, PROMETHEUS_HINT, REPO, free_port, require_tool

ENV_EXAMPLE = DEPLOY / ".env.example"
DOCKERFILE = REPO / "Dockerfile"
#: The services run as local processes (test_compose_commands.py); the others and why not.
RUN = ("avest", "replay", "vllm-sim", "prometheus")
NOT_RUN = {
    "vllm-0": "a vLLM worker: needs a GPU and model weights",
    "vllm-1": "a vLLM worker: needs a GPU and model weights",
    "grafana": "Grafana is not installed here; its dashboard's queries are run against Prometheus",
    "postgres": "the postgres profile: its replicas are run by test_compose_replicas.py",
    "avest-r1": "the postgres profile: run by test_compose_replicas.py",
    "avest-r2": "the postgres profile: run by test_compose_replicas.py",
}


# -- docker compose config --------------------------------------------------------------


#: Values for the settings compose requires (deploy/.env.example).
COMPOSE_ENV = {
    "AVEST_WORKER_TOKEN": "worker-token-for-tests",
    "AVEST_ADMIN_TOKEN": "admin-token-for-tests",
    "GRAFANA_ADMIN_PASSWORD": "grafana-password-for-tests",
}


def compose_config(*profiles: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    r = compose_run(*profiles, env={**COMPOSE_ENV, **(env or {})})
    assert r.returncode == 0, f"docker compose {' '.join(profiles)} config:\n{r.stderr}"
    return json.loads(r.stdout)


def compose_run(*profiles: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``docker compose config`` with exactly ``env`` for compose's settings
    (none from the caller's environment, none from a deploy/.env)."""
    cmd = compose_command()
    if cmd is None:
        pytest.skip(f"docker compose (v2+) not found: {COMPOSE_HINT}")
    args = [*cmd, "-f", str(COMPOSE)]
    for p in profiles:
        args += ["--profile", p]
    settings = set(COMPOSE_ENV) | {"TARGET_MODEL", "DRAFT_MODEL", "NUM_SPECULATIVE_TOKENS"}
    settings |= {"HF_TOKEN", "HF_CACHE", "AVEST_LABELS", "AVEST_REFIT_INTERVAL"}
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_") and k not in settings
    }
    clean.update({"HOME": os.environ.get("HOME", "/root"), **env})
    # An empty env file: a developer's deploy/.env must not fill in what a test leaves out.
    args += ["--env-file", os.devnull]
    return subprocess.run(
        [*args, "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=DEPLOY,
        env=clean,
    )


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
    read: int = field(default_factory=free_port)
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
        "0.0.0.0:50052": f"127.0.0.1:{ports.read}",
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
