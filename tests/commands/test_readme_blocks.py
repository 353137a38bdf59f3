"""Every command and code block in README.md, the pages of docs/ and
deploy/README.md is accounted for: run here as a user would run it (:data:`RUN`), checked statically where it
needs what this machine has not got (:data:`CHECKED`: a Docker engine, a
cluster, a GPU), or listed with the reason it is not run (:data:`NOT_RUN`).
A command or block that is in none of the three fails
:func:`test_every_readme_command_is_run_checked_or_listed`.

The unit is one shell command (a logical line: continuations joined, ``&&``
chains split, comments dropped) or one whole Python block. Commands run with
the READMEs' own text; the only substitutions are the addresses (a service on
127.0.0.1:0 through ``AVEST_GRPC_ADDRESS``/``AVEST_HTTP_ADDRESS``, the address it
announces given to the next commands as ``--address``) and the documented placeholders
(``path/to/trace.npz``), each named where it is made.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
READMES = (
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    REPO / "deploy" / "README.md",
)
VENV_BIN = Path(sys.executable).parent
ANNOUNCE = re.compile(r"avest serving grpc=(\S+) http=(https?://\S+)")
SHARED_TRACES = REPO.parent / "shared" / "traces"


@dataclass(frozen=True)
class Unit:
    readme: str
    line: int
    lang: str
    text: str  # one shell command, or a whole Python block


def readme_units() -> list[Unit]:
    units: list[Unit] = []
    for path in READMES:
        text = path.read_text()
        for m in re.finditer(r"(?ms)^```(\w*)\n(.*?)^```", text):
            lang, body = m.group(1), m.group(2)
            line = text[: m.start()].count("\n") + 2
            name = path.relative_to(REPO).as_posix()
            if lang == "python":
                units.append(Unit(name, line, lang, body))
                continue
            assert lang in ("sh", "bash", "console", ""), f"{name}:{line}: a ```{lang} block"
            logical = ""
            for raw in body.splitlines():
                code = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
                if code.endswith("\\"):
                    logical += code[:-1].rstrip() + " "
                    continue
                logical = (logical + code.strip()).strip()
                # `a && b` is two commands; a subshell `( ... )` stays one.
                chain = [logical] if logical.startswith("(") else re.split(r"\s+&&\s+", logical)
                for command in chain if logical else []:
                    units.append(Unit(name, line, lang or "sh", " ".join(command.split())))
                logical = ""
    return units


# -- the classification ---------------------------------------------------------------

QUICK_START = (
    ".venv/bin/avest demo",
    ".venv/bin/avest serve &",
    ".venv/bin/avest replay --workers 4 path/to/trace.npz",
    ".venv/bin/avest pairs",
)
PYTHON_CLIENT = "python: from avest_client import EstimatorClient"
BUF_LIST = "npx buf curl --protocol grpc --http2-prior-knowledge http://127.0.0.1:50051/avest.v1.EstimatorService/ListPairs"
BUF_REGISTER = (
    'npx buf curl --protocol grpc --http2-prior-knowledge -d \'{"key": {"target_model": "t", '
    '"draft_model": "d", "method": "draft_model", "num_speculative_tokens": 5}}\' '
    "http://127.0.0.1:50051/avest.v1.EstimatorService/RegisterPair"
)
FLEET = (
    "avest fleet ../shared/traces/chat-rtn4g32-t1.0-k5.npz ../shared/traces/code-rtn4g128-t0.7-k6.npz "
    "../shared/traces/greedy-shift-story-chat-rtn4g64-t0-k5.npz --workers 8 --restart-every 0,200 "
    "--no-goodput"
)
KUSTOMIZE = "kubectl kustomize deploy/kubernetes/base | less"

#: Run here (the test that runs each is named).
RUN = {
    ".venv/bin/avest serve": "test_install_block_serve_starts_on_the_addresses_it_is_given",
    **dict.fromkeys(QUICK_START, "test_quick_start_commands"),
    PYTHON_CLIENT: "test_python_client_snippet_runs_against_a_live_server",
    BUF_LIST: "test_buf_curl_commands_against_a_live_server",
    BUF_REGISTER: "test_buf_curl_commands_against_a_live_server",
    "cd deploy": "test_demo_compose_commands (the .env copy made in a copy of deploy/)",
    "cp .env.example .env": "test_demo_compose_commands",
    KUSTOMIZE: "test_kubectl_kustomize_renders_the_base (without the pager)",
    FLEET: "test_fleet_table_is_what_its_command_prints (with --json)",
}

#: Not runnable here; a static equivalent is run instead (test named).
CHECKED = {
    "docker compose --profile demo up --build": "no Docker engine: test_demo_compose_commands "
    "runs `docker compose --profile demo config` on the copied .env (the services themselves run "
    "as local processes in tests/deploy/test_compose_commands.py)",
    "TARGET_MODEL=Qwen/Qwen3-8B DRAFT_MODEL=Qwen/Qwen3-0.6B NUM_SPECULATIVE_TOKENS=5 docker compose "
    "--profile gpu up --build": "GPUs and no Docker engine: test_gpu_compose_commands runs "
    "`docker compose config` with the same settings",
    "docker compose --profile gpu --profile gpu-2 up --build": "GPUs and no Docker engine: "
    "test_gpu_compose_commands",
    "docker compose --profile postgres up --build": "no Docker engine: "
    "tests/deploy/test_deploy_replicas.py renders the profile with `docker compose config` and "
    "tests/deploy/test_compose_replicas.py runs its replicas as local processes on a real "
    "PostgreSQL",
    "docker run --rm avest:local --help": "no Docker engine: test_image_help_lists_every_setting "
    "runs the image's entrypoint (`avest serve`) with --help",
    "AVEST_ADDRESS=avest:50051 AVEST_LABELS=temperature=0.7 vllm serve Qwen/Qwen3-8B "
    '--speculative-config \'{"method": "draft_model", "model": "Qwen/Qwen3-0.6B", '
    '"num_speculative_tokens": 5, "enable_adaptive_verification": true, '
    '"draft_sample_method": "probabilistic"}\'': "a GPU and model weights: "
    "test_vllm_serve_command_is_well_formed checks the speculative config (and the flags against "
    "vLLM's own parser when vLLM is importable)",
}

_NO_ENGINE = "needs a Docker engine (none here); hadolint and the image's instructions: tests/deploy/test_deploy_docker.py"
_CLUSTER = "needs a Kubernetes cluster; the manifests are validated offline in tests/deploy/test_deploy_kubernetes.py"

#: Not run, and why.
NOT_RUN = {
    "python3 -m venv .venv": "makes the environment these tests already run in",
    ".venv/bin/pip install -e '.[server]'": "installs from the package registry; scripts/check "
    "installs the same extra (with the test tools) before these tests run",
    "scripts/check": "the whole suite, this test included",
    "AVEST_FUZZ_EXAMPLES=10000 AVEST_SCHEMATHESIS_EXAMPLES=1000 .venv/bin/python -m pytest -q "
    "tests/fuzz": "the long fuzzing run (about 30 minutes); scripts/check runs tests/fuzz on "
    "its short budget",
    "docker build -t avest:local .": _NO_ENGINE,
    "docker run --rm -p 127.0.0.1:50051:50051 -p 127.0.0.1:50052:50052 -p 127.0.0.1:8000:8000 "
    "-v avest-data:/data -e AVEST_WORKER_TOKEN=... -e AVEST_ADMIN_TOKEN=... avest:local": _NO_ENGINE
    + "; the image's command and environment run locally in tests/deploy/test_compose_commands.py",
    "docker build -t registry.example.com/avest:0.1.0 .": _NO_ENGINE,
    "docker push registry.example.com/avest:0.1.0": "needs a registry",
    "docker build -f deploy/vllm/Dockerfile -t registry.example.com/avest-vllm:0.33.0 .": _NO_ENGINE,
    "docker push registry.example.com/avest-vllm:0.33.0": "needs a registry",
    "kubectl create namespace avest": _CLUSTER,
    'kubectl -n avest create secret generic avest-tokens --from-literal=worker-token="$(openssl '
    'rand -hex 32)" --from-literal=admin-token="$(openssl rand -hex 32)"': _CLUSTER,
    "(cd deploy/kubernetes/base && kustomize edit set image avest=registry.example.com/avest:0.1.0)": (
        "edits base/kustomization.yaml in place (and kustomize is not installed); the `images:` "
        "entry it edits is checked in tests/deploy/test_deploy_kubernetes.py"
    ),
    "kubectl apply -k deploy/kubernetes/base": _CLUSTER,
    'PASSWORD="$(openssl rand -hex 32)"': "sets a shell variable for the secret below",
    'kubectl -n avest create secret generic avest-store --from-literal=postgres-password="$PASSWORD" '
    '--from-literal=url="postgresql://avest:$PASSWORD@avest-postgres:5432/avest"': _CLUSTER
    + "; the URL's host, port, user and database against the demo PostgreSQL: "
    "tests/deploy/test_deploy_replicas.py",
    "(cd deploy/kubernetes/replicas && kustomize edit set image avest=registry.example.com/avest:0.1.0)": (
        "edits replicas/kustomization.yaml in place (and kustomize is not installed); its "
        "`images:` entry is checked in tests/deploy/test_deploy_replicas.py"
    ),
    "kubectl apply -k deploy/kubernetes/replicas": _CLUSTER,
    "kubectl -n avest rollout status statefulset/avest-postgres": _CLUSTER,
    "kubectl -n avest rollout status deployment/avest": _CLUSTER,
    'sed -i "s/^AVEST_POSTGRES_PASSWORD=.*/AVEST_POSTGRES_PASSWORD=$(openssl rand -hex 32)/" .env': (
        "edits the compose stack's .env; the setting is in .env.example "
        "(tests/deploy/test_deploy_replicas.py)"
    ),
    "kubectl -n avest rollout status statefulset/avest": _CLUSTER,
    "helm upgrade kube-prometheus-stack prometheus-community/kube-prometheus-stack -n monitoring "
    "--reuse-values --set grafana.sidecar.dashboards.searchNamespace=ALL": _CLUSTER
    + " with kube-prometheus-stack installed by Helm",
    "kubectl -n monitoring apply -k deploy/grafana": _CLUSTER,
    "kubectl -n avest get secret avest-tokens -o json | jq '{apiVersion, kind, type, metadata: "
    '{name: .metadata.name}, data: {"worker-token": .data["worker-token"]}}\' | kubectl -n <vllm '
    "namespace> apply -f -": _CLUSTER,
    "kubectl -n <vllm namespace> patch deployment <vllm deployment> --type strategic --patch-file "
    "deploy/kubernetes/vllm/shim-patch.yaml": _CLUSTER,
    "kubectl -n monitoring port-forward svc/kube-prometheus-stack-prometheus 9090 &": _CLUSTER,
    "curl -s 'http://127.0.0.1:9090/api/v1/query?query=avest_info' | jq '.data.result'": "the "
    "cluster's Prometheus through the port-forward above; the same queries against a real "
    "Prometheus: tests/deploy/test_deploy_prometheus.py",
    "curl -s http://127.0.0.1:9090/api/v1/rules | jq '[.data.groups[].name]'": "the cluster's "
    "Prometheus through the port-forward above; the rules' load: tests/deploy/test_deploy_prometheus.py",
}


def unit_key(unit: Unit) -> str:
    if unit.lang == "python":
        first = next(line for line in unit.text.splitlines() if "avest_client" in line)
        return f"python: {first.strip()}"
    return unit.text


def test_every_readme_command_is_run_checked_or_listed() -> None:
    keys = [unit_key(u) for u in readme_units()]
    assert len(keys) > 20
    classified = set(RUN) | set(CHECKED) | set(NOT_RUN)
    assert not set(RUN) & set(CHECKED) and not set(RUN) & set(NOT_RUN)
    assert not set(CHECKED) & set(NOT_RUN)
    missing = [
        f"{u.readme}:{u.line}: {unit_key(u)}"
        for u in readme_units()
        if unit_key(u) not in classified
    ]
    assert not missing, "README commands neither run, checked nor listed here:\n" + "\n".join(
        missing
    )
    stale = classified - set(keys)
    assert not stale, f"listed here but no longer in a README: {sorted(stale)}"


def python_block(key: str) -> str:
    (unit,) = [u for u in readme_units() if unit_key(u) == key]
    return unit.text


# -- processes ------------------------------------------------------------------------


@dataclass
class Background:
    proc: subprocess.Popen[str]
    cwd: Path
    lines: list[str]
    announced: threading.Event

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def address(self) -> tuple[str, str]:
        for line in self.lines:
            m = ANNOUNCE.search(line)
            if m:
                return m.group(1), m.group(2)
        raise AssertionError("no announcement:\n" + self.output())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
        return self.proc.returncode


def workdir(tmp: Path) -> Path:
    """A user's checkout as far as the commands need it: ``.venv`` (this venv)."""
    (tmp / ".venv").symlink_to(VENV_BIN.parent, target_is_directory=True)
    return tmp


def user_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AVEST_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def background(command: str, cwd: Path, env: dict[str, str], timeout: float = 60) -> Background:
    """A README command that keeps running (``avest serve``, ``avest demo``), in
    its own process group; returns once it announced its addresses."""
    proc = subprocess.Popen(
        ["/bin/sh", "-c", "exec " + command.removesuffix("&").strip()],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    bg = Background(proc, cwd, [], threading.Event())

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            bg.lines.append(line.rstrip("\n"))
            if ANNOUNCE.search(line):
                bg.announced.set()
        bg.announced.set()

    threading.Thread(target=pump, daemon=True).start()
    if not bg.announced.wait(timeout) or proc.poll() is not None:
        bg.stop()
        raise AssertionError(f"{command!r} did not announce itself:\n{bg.output()}")
    return bg


def shell(command: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    r = subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert r.returncode == 0, f"{command!r} exited {r.returncode}:\n{r.stdout}\n{r.stderr}"
    return r.stdout


LOOPBACK_0 = {"AVEST_GRPC_ADDRESS": "127.0.0.1:0", "AVEST_HTTP_ADDRESS": "127.0.0.1:0"}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Background]:
    """The install block's ``.venv/bin/avest serve`` (on 127.0.0.1:0)."""
    assert ".venv/bin/avest serve" in RUN
    bg = background(".venv/bin/avest serve", workdir(tmp_path), user_env(**LOOPBACK_0))
    yield bg
    assert bg.stop() == 0, bg.output()


# -- README.md ------------------------------------------------------------------------


def test_install_block_serve_starts_on_the_addresses_it_is_given(served: Background) -> None:
    import urllib.request

    grpc_address, http_url = served.address()
    assert grpc_address.startswith("127.0.0.1:") and not grpc_address.endswith(":0")
    with urllib.request.urlopen(http_url.rstrip("/") + "/healthz", timeout=5) as resp:  # noqa: S310
        assert resp.status == 200
    # The embedded default data directory, in the directory it was started in.
    assert (served.cwd / "avest-data").is_dir(), served.output()


def test_quick_start_commands(tmp_path: Path) -> None:
    """The quick start as written: ``avest demo`` (given loopback ports 0, stopped
    with Ctrl-C once it has refitted), then ``avest serve &``, ``avest replay``
    of the bundled trace (for ``path/to/trace.npz``) and ``avest pairs``, both
    given ``--address`` of the address that serve announced."""
    from avest.offline.trace import bundled_sample_path, read_trace

    cwd = workdir(tmp_path)
    demo, serve, replay, pairs = QUICK_START
    # 1. The demo: it serves, replays and prints refits; Ctrl-C stops it cleanly.
    bg = background(
        f"{demo} --grpc-address 127.0.0.1:0 --http-address 127.0.0.1:0", cwd, user_env(), 90
    )
    try:
        deadline = time.monotonic() + 120
        while "serving; Ctrl-C to stop" not in bg.output() and time.monotonic() < deadline:
            assert bg.proc.poll() is None, bg.output()
            time.sleep(0.5)
        assert "serving; Ctrl-C to stop" in bg.output(), bg.output()
        assert "reliability diagram:" in bg.output()
    finally:
        assert bg.stop(signal.SIGINT) in (0, 130, -signal.SIGINT), bg.output()
    # 2-4. A service of one's own, fed and listed.
    server = background(serve, cwd, user_env(**LOOPBACK_0))
    try:
        grpc_address, http_url = server.address()
        env = user_env()
        at = f" --address {grpc_address}"
        trace = str(bundled_sample_path())
        out = shell(replay.replace("path/to/trace.npz", trace) + at, cwd, env)
        assert "replayed" in out and "as 4 worker(s)" in out, out
        listed = shell(pairs + at, cwd, env)
        target = str(read_trace(bundled_sample_path()).meta["target"])
        assert target in listed and "K=5" in listed, listed
        m = re.search(r"steps (\d+)", listed)
        assert m and int(m.group(1)) > 0, listed
        # ... and it was this service that learned it (its own admin HTTP API).
        import urllib.request

        with urllib.request.urlopen(f"{http_url.rstrip('/')}/v1/pairs", timeout=5) as resp:  # noqa: S310
            held = json.loads(resp.read())
        held = held.get("pairs", held) if isinstance(held, dict) else held
        assert [p["observed_steps"] for p in held] == [int(m.group(1))], held
    finally:
        assert server.stop() == 0, server.output()


def test_python_client_snippet_runs_against_a_live_server(served: Background) -> None:
    code = python_block(PYTHON_CLIENT)
    assert code.count('"127.0.0.1:50051"') == 1
    grpc_address, _ = served.address()
    r = subprocess.run(
        [sys.executable, "-c", code.replace('"127.0.0.1:50051"', json.dumps(grpc_address))],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=user_env(),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    # It prints what the forwarder last received: Coefficients(slope, intercepts, version, ...).
    printed = r.stdout.strip().splitlines()[-1]
    m = re.match(r"Coefficients\(slope=([-\d.e]+), intercepts=\((.*)\), version=(\d+),", printed)
    assert m, printed
    assert len(m.group(2).split(",")) == 5


def buf_binary() -> str:
    for candidate in (REPO / "node_modules" / ".bin" / "buf", shutil.which("buf")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    pytest.skip("buf not installed: `npm ci` in the repository installs the pinned one")


def test_buf_curl_commands_against_a_live_server(served: Background) -> None:
    """The two ``buf curl`` calls, ``npx buf`` being the buf that ``npm ci``
    installs and the address the live server's."""
    buf = buf_binary()
    grpc_address, _ = served.address()
    env = user_env()
    register = BUF_REGISTER.replace("npx buf", shlex.quote(buf)).replace(
        "127.0.0.1:50051", grpc_address
    )
    reg = json.loads(shell(register, REPO, env))
    assert reg["pairId"] and reg.get("created") is True, reg
    listed = json.loads(
        shell(
            BUF_LIST.replace("npx buf", shlex.quote(buf)).replace("127.0.0.1:50051", grpc_address),
            REPO,
            env,
        )
    )
    assert [p["pairId"] for p in listed["pairs"]] == [reg["pairId"]], listed


#: The fleet table's rows: the traces as the README names them.
FLEET_TRACES = {
    "chat-rtn4g32-t1.0-k5.npz": "chat (K=5, T=1.0)",
    "code-rtn4g128-t0.7-k6.npz": "code (K=6, T=0.7)",
    "greedy-shift-story-chat-rtn4g64-t0-k5.npz": "story/chat shift (K=5, T=0)",
}
FLEET_TABLE = re.compile(r"<!-- fleet table:[^\n]*-->\n(.*?)<!-- end of the fleet table -->", re.S)


def fleet_table(report: dict[str, object]) -> str:
    """The README's fleet table from ``avest fleet ... --json``: in-worker against
    pooled (served through the calibration layer), overall and early ECE, log loss."""
    rows = [
        "| trace | restarts | ECE in-worker | ECE pooled | ECE in the 100 steps after a "
        "(re)start: in-worker / pooled | log loss in-worker / pooled |",
        "|---|---|---|---|---|---|",
    ]
    fleets = report["fleets"]
    assert isinstance(fleets, list)
    for f in fleets:
        assert f["workers"] == 8 and f["early_steps"] == 100, f
        mine, pooled = f["estimators"]["in-worker"], f["estimators"]["pooled+calibration"]
        every = f["restart_every"]
        restarts = f"every {every} steps" if every else "none"
        rows.append(
            f"| {FLEET_TRACES[Path(f['trace']).name]} | {restarts} "
            f"| {mine['overall']['ece']:.3f} | {pooled['overall']['ece']:.3f} "
            f"| {mine['early']['ece']:.3f} / {pooled['early']['ece']:.3f} "
            f"| {mine['overall']['logloss']:.3f} / {pooled['overall']['logloss']:.3f} |"
        )
    return "\n".join(rows) + "\n"


def test_fleet_table_is_what_its_command_prints() -> None:
    """The README's headline table, regenerated: its own command, run from the
    repository root (where ``../shared/traces`` is) with ``--json``."""
    if not all((SHARED_TRACES / name).is_file() for name in FLEET_TRACES):
        pytest.skip(f"the shared traces are not in {SHARED_TRACES}")
    assert FLEET.startswith("avest ")
    command = shlex.quote(str(VENV_BIN / "avest")) + FLEET.removeprefix("avest") + " --json"
    report = json.loads(shell(command, REPO, user_env(), timeout=600))
    m = FLEET_TABLE.search((REPO / "README.md").read_text())
    assert m, "README.md has no fleet table between its markers"
    assert m.group(1) == fleet_table(report), "README's fleet table; the command prints:\n" + (
        fleet_table(report)
    )


def test_vllm_serve_command_is_well_formed() -> None:
    (command,) = [k for k in CHECKED if " vllm serve " in k]
    argv = shlex.split(command)
    env = dict(a.split("=", 1) for a in argv[: argv.index("vllm")])
    assert env["AVEST_ADDRESS"] == "avest:50051"
    assert env["AVEST_LABELS"] == "temperature=0.7"
    args = argv[argv.index("serve") + 1 :]
    assert args[0] == "Qwen/Qwen3-8B"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    # vLLM builds its online estimator only with these two (README's own words).
    assert spec["enable_adaptive_verification"] is True
    assert spec["draft_sample_method"] == "probabilistic"
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 5
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found]
        from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]
    except ImportError:
        return  # vLLM is not importable here: the flags are checked by shape only
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    parsed = parser.parse_args(["--model", args[0], *args[1:]])
    assert parsed.speculative_config["num_speculative_tokens"] == 5


# -- deploy/README.md -----------------------------------------------------------------


def compose_binary() -> list[str]:
    from tests.support.docker import COMPOSE_HINT, compose_command

    cmd = compose_command()
    if cmd is None:
        pytest.skip(f"docker compose (v2+) not found: {COMPOSE_HINT}")
    return cmd


def compose(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``docker compose ARGS`` in ``cwd``, its output captured."""
    argv = [*compose_binary(), *args]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def compose_config(cwd: Path, profiles: list[str], env: dict[str, str]) -> dict[str, object]:
    profile_args = [a for p in profiles for a in ("--profile", p)]
    r = compose(cwd, env, *profile_args, "config", "--format", "json")
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def compose_env(**extra: str) -> dict[str, str]:
    settings = (
        "AVEST_",
        "GRAFANA_",
        "TARGET_MODEL",
        "DRAFT_MODEL",
        "NUM_SPECULATIVE",
        "HF_",
        "COMPOSE_",
    )
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(settings)},
        **extra,
    }


def test_demo_compose_commands(tmp_path: Path) -> None:
    """``cd deploy`` and ``cp .env.example .env`` in a copy of deploy/, the values
    filled in as .env.example's own ``sed`` lines fill them, then compose reads
    that .env: ``docker compose --profile demo config`` stands for ``up``."""
    deploy = tmp_path / "deploy"
    shutil.copytree(REPO / "deploy", deploy, ignore=shutil.ignore_patterns(".env"))
    env = compose_env()
    shell("cp .env.example .env", deploy, env)
    sed = re.findall(r"(?m)^#   (sed -i .*)$", (deploy / ".env.example").read_text())
    assert len(sed) == 4, sed
    for command in sed:
        shell(command, deploy, env)
    values = dict(
        line.split("=", 1)
        for line in (deploy / ".env").read_text().splitlines()
        if re.match(r"^[A-Z_]+=", line)
    )
    assert (
        all(
            len(values[k]) >= 32
            for k in ("AVEST_WORKER_TOKEN", "AVEST_ADMIN_TOKEN", "AVEST_POSTGRES_PASSWORD")
        )
        and len(values["GRAFANA_ADMIN_PASSWORD"]) >= 32
    )
    cfg = compose_config(deploy, ["demo"], env)
    services = cfg["services"]
    assert isinstance(services, dict)
    assert {"avest", "replay", "vllm-sim", "prometheus", "grafana"} <= set(services)
    assert services["avest"]["environment"]["AVEST_WORKER_TOKEN"] == values["AVEST_WORKER_TOKEN"]
    assert services["replay"]["environment"]["AVEST_TOKEN"] == values["AVEST_WORKER_TOKEN"]
    # Without the filled .env compose refuses, as the README says.
    (deploy / ".env").write_text((REPO / "deploy" / ".env.example").read_text())
    r = compose(deploy, env, "--profile", "demo", "config")
    assert r.returncode != 0 and "AVEST_WORKER_TOKEN" in r.stderr, r.stderr


def test_gpu_compose_commands(tmp_path: Path) -> None:
    tokens = {
        "AVEST_WORKER_TOKEN": "w" * 32,
        "AVEST_ADMIN_TOKEN": "a" * 32,
        "GRAFANA_ADMIN_PASSWORD": "g" * 16,
    }
    (one,) = [k for k in CHECKED if "--profile gpu up" in k]
    settings = dict(a.split("=", 1) for a in shlex.split(one) if "=" in a and not a.startswith("-"))
    cfg = compose_config(REPO / "deploy", ["gpu"], compose_env(**tokens, **settings))
    worker = cfg["services"]["vllm-0"]  # type: ignore[index]
    assert worker["command"][0] == settings["TARGET_MODEL"]
    spec = json.loads(worker["command"][worker["command"].index("--speculative-config") + 1])
    assert spec["model"] == settings["DRAFT_MODEL"]
    assert spec["num_speculative_tokens"] == int(settings["NUM_SPECULATIVE_TOKENS"])
    two = compose_config(REPO / "deploy", ["gpu", "gpu-2"], compose_env(**tokens))
    assert {"vllm-0", "vllm-1"} <= set(two["services"])  # type: ignore[arg-type]


def test_image_help_lists_every_setting() -> None:
    """``docker run --rm avest:local --help``: the image's entrypoint (``avest
    serve``, from the Dockerfile) with ``--help``, run here."""
    from avest.settings import Settings, env_name
    from tests.support.docker import stages

    entrypoint = json.loads(
        next(rest for word, rest in stages(REPO / "Dockerfile")[-1] if word == "ENTRYPOINT")
    )
    assert entrypoint == ["avest", "serve"]
    out = shell(f"{VENV_BIN / 'avest'} serve --help", REPO, user_env())
    for name in Settings.model_fields:
        assert env_name(name) in out, name


def test_kubectl_kustomize_renders_the_base() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (optional: scripts/check does not need it)")
    out = shell(KUSTOMIZE.removesuffix("| less").strip(), REPO, user_env())
    kinds = {d["kind"] for d in yaml.safe_load_all(out) if d}
    assert {"StatefulSet", "Service", "ServiceMonitor", "PrometheusRule", "ConfigMap"} <= kinds
