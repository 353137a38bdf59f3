"""The plugin on vLLM 0.33's real classes, against a live sidecar.

vLLM's plugin loader, speculator module, ``DraftModelSpeculator.load_model``,
``_maybe_predict_acceptance``, ``observe_verification`` and
``OnlineAcceptanceEstimator`` (its Triton kernels run in Triton's interpreter)
are driven by ``real_vllm_driver.py`` in a virtual environment of their own,
``.venv-vllm`` (built by ``scripts/vllm-env``), in a subprocess, so this
suite's environment is untouched. The sidecar is the real server on
127.0.0.1:0, in this process.

Torch: vLLM 0.33.0's metadata pins ``torch==2.14.0``; the wheel goes in with
``--no-deps`` and this test runs on the CPU build of torch 2.13.0.

The test checks that the plugin, loaded by vLLM through its entry point,
replaces the estimator the speculator builds; that what the sidecar learned
equals ``avest replay`` of the very steps the shim forwarded (replayed into
a second server); that pooled coefficients are copied into the estimator's
own tensors (same storage) and are those in force at the end; and that vLLM's
local refits are skipped while pooled coefficients govern. It is
parametrised over the shim's modes (``MODES`` of the shim's config, ``raw``
where there is none). A third run checks the pair's calibration layer inside
vLLM's real ``predict``: the pair is first fed drafts its logistic cannot
follow until the sidecar serves the layer, then the driver's worker gets the
table with its warm start, and the confidences vLLM's adaptive verification
reads must be the table's map of vLLM's own linear confidences, computed
with no host synchronisation and one op sequence per batch size.

Where is the environment? ``$AVEST_VLLM_PYTHON`` (an interpreter), else
``.venv-vllm/bin/python``. ``scripts/check`` builds it (CI sets ``CI``); if
it is absent the test fails with the reason under CI and is skipped with the
reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from avest.commands.cli import main as avest_main
from avest.offline.trace import FORMAT, Trace, write_trace
from avest_client import EstimatorClient
from avest_client.vllm import config as shim_config
from tests.support.helpers import f32, missing_environment

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("real_vllm_driver.py")
STEPS, REQUESTS, K = 24, 16, 4
#: Steps of the calibration-table run (short: the table is checked at every step).
TABLE_STEPS = 8
#: vLLM's local refit point (the driver's subclass) and the sidecar's round.
LOCAL_REFIT, SIDECAR_REFIT = 4, 3
MODES = tuple(getattr(shim_config, "MODES", ("raw",)))


def vllm_python() -> Path | None:
    given = os.environ.get("AVEST_VLLM_PYTHON")
    if given:
        return Path(given)
    venv = REPO / ".venv-vllm" / "bin" / "python"
    return venv if venv.exists() else None


@pytest.fixture(scope="module")
def python() -> Path:
    py = vllm_python()
    if py is None or not py.exists():
        reason = (
            f"no vLLM 0.33 environment at {py or REPO / '.venv-vllm'}: run scripts/vllm-env "
            "WHEEL (scripts/check does) or set AVEST_VLLM_PYTHON. vLLM's real classes are NOT "
            "tested."
        )
        missing_environment(reason, REPO / ".cache" / "vllm-env.log")
    return py


def drive(
    python: Path, address: str, mode: str, out: Path, steps: int = STEPS, **extra: str
) -> dict:
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_PLUGINS": "avest",
        "AVEST_ADDRESS": address,
        "AVEST_MODE": mode,
        "AVEST_QUEUE_SIZE": "4096",
        "AVEST_TIMEOUT_S": "20",
        "PYTHONPATH": "",  # the venv's own avest (editable), not this suite's path
        **extra,
    }
    args = [str(python), str(DRIVER), str(out), str(steps), str(REQUESTS), str(K)]
    proc = subprocess.run(
        [*args, str(LOCAL_REFIT)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("mode", MODES)
def test_the_plugin_on_vllms_real_classes(python, start_sidecar, tmp_path, mode, capsys):
    live = start_sidecar(tmp_path / "live", refit_interval=SIDECAR_REFIT, default_rule="vllm")
    got = drive(python, live.grpc_address, mode, tmp_path)
    assert got["torch"].startswith("2.13.0")
    assert got["mode"] == mode
    # vLLM's plugin loader found avest; load_model built the shim over vLLM's class
    assert got["base_class"] == (
        "vllm.v1.worker.gpu.spec_decode.acceptance_estimator.OnlineAcceptanceEstimator"
    )
    assert got["refit_interval"] == LOCAL_REFIT
    # vLLM's confidences are its linear ones wherever no table is served (none is primed)
    assert len(got["table_checks"]) == STEPS
    assert max(c["err"] for c in got["table_checks"]) <= 1e-6
    assert got["table_ops"]["host_syncs"] == []

    with EstimatorClient(live.grpc_address) as client:
        pair = client.pair(got["pair_id"])
    assert (pair.key.target, pair.key.draft, pair.key.k) == ("avest-ci/target", "avest-ci/draft", K)
    if mode == "summary":
        _check_summary_mode(got, pair)
        return
    assert pair.steps_observed == STEPS
    assert pair.coefficients.version == STEPS // SIDECAR_REFIT

    # The same steps, as the shim forwarded them, replayed with `avest replay`.
    steps = dict(np.load(tmp_path / "steps.npz"))
    trace = Trace(
        meta={
            "format": FORMAT,
            "target": "avest-ci/target",
            "draft": "avest-ci/draft",
            "method": "draft_model",
            "num_speculative_tokens": K,
            "temperature": 1.0,
            "top_p": 1.0,
        },
        **steps,
    )
    path = write_trace(tmp_path / "forwarded.npz", trace)
    other = start_sidecar(tmp_path / "replay", refit_interval=SIDECAR_REFIT, default_rule="vllm")
    capsys.readouterr()
    assert avest_main(["replay", str(path), "--address", other.grpc_address, "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)
    assert replay["messages"] == STEPS
    assert replay["drafts_observed"] == pair.drafts_observed == trace.labelled_count()
    assert replay["version"] == pair.coefficients.version
    c = pair.coefficients
    if mode == "raw":
        assert c.slope == replay["slope"]
        assert list(c.intercepts) == replay["intercepts"]
    else:  # statistics pooled on the device, in float32
        assert c.slope == pytest.approx(replay["slope"], rel=1e-5, abs=1e-6)
        assert list(c.intercepts) == pytest.approx(replay["intercepts"], rel=1e-5, abs=1e-6)

    # Pooled coefficients applied in place: same storage at every step, the
    # server's latest in force at the end, several versions on the way.
    assert all(same for *_, same in got["applied_per_step"])
    versions = [v for v, *_ in got["applied_per_step"]]
    assert versions == sorted(versions) and len(set(versions)) >= 4, versions
    assert got["stats"]["version"] == c.version == got["latest"][0]
    assert got["slope"] == f32(c.slope) and got["slope"] != f32(0.5)
    assert got["intercepts"] == [f32(b) for b in c.intercepts]
    # ... and vLLM's own refits skipped at each of its refit points
    st = got["stats"]
    assert st["governed"] and got["local_refits"] == 0
    assert st["skipped_refits"] == STEPS // LOCAL_REFIT
    if mode == "raw":
        assert st["captured"] == st["submitted"] == STEPS and st["dropped"] == 0
    print(f"real vLLM driver ({mode}): {got['seconds']}", file=sys.stderr)


def _check_summary_mode(got: dict, pair) -> None:  # noqa: ANN001
    """Summary mode: rounds are sent from the first step scored at pooled coefficients
    on, the last (open) round included when the shim closes; the steps before the warm
    start applies stay vLLM's own. Raw against summary equivalence is tested against
    the live server in tests/client/test_summary_mode.py."""
    c = pair.coefficients
    assert STEPS - LOCAL_REFIT < pair.steps_observed <= STEPS
    assert c.version >= 1
    assert all(same for *_, same in got["applied_per_step"])
    versions = [v for v, *_ in got["applied_per_step"]]
    assert versions == sorted(versions) and len(set(versions)) >= 3, versions
    # the round sent at close may refit once more after the shim's last step
    assert 1 <= got["stats"]["version"] <= c.version <= got["stats"]["version"] + 1
    assert got["slope"] != f32(0.5)
    st = got["stats"]
    assert st["governed"] and got["local_refits"] == 0
    assert st["summaries"] >= 1


def test_summary_rounds_longer_than_vllms_interval(python, start_sidecar, tmp_path):
    """AVEST_ROUND_STEPS above vLLM's REFIT_INTERVAL: vLLM's real step keeps summing
    across its own refit points (each one skipped, none run), and the worker sends one
    summary per long round (the sidecar does not refit meanwhile, so no update cuts a
    round short)."""
    live = start_sidecar(tmp_path / "live", refit_interval=100 * STEPS, default_rule="vllm")
    long_round = 3 * LOCAL_REFIT
    got = drive(python, live.grpc_address, "summary", tmp_path, AVEST_ROUND_STEPS=str(long_round))
    with EstimatorClient(live.grpc_address) as client:
        pair = client.pair(got["pair_id"])
    st = got["stats"]
    assert st["governed"] and got["local_refits"] == 0
    assert st["skipped_refits"] >= STEPS // LOCAL_REFIT - 1
    # whole long rounds, plus the open one sent at close
    assert 1 <= st["summaries"] <= STEPS // long_round + 1
    assert STEPS - LOCAL_REFIT < pair.steps_observed <= STEPS
    assert pair.drafts_observed > 0 and pair.coefficients.version == 0


def prime_served_layer(address: str) -> tuple[str, tuple]:
    """Register the driver's pair and feed it drafts the logistic cannot follow (accepted
    at 0.95 above x = 0, at 0.3 below) until its calibration layer is served; the pair's
    id and the table pushed with its latest coefficients."""
    rng = np.random.default_rng(3)
    with EstimatorClient(address) as client:
        labels = {"draft_sample_method": "probabilistic"}
        reg = client.register("avest-ci/target", "avest-ci/draft", "draft_model", K, labels)
        fwd = client.forwarder(reg.pair_id, "primer", k=K)
        for _ in range(120):  # served after about 20 steps; the rest builds a margin
            x = rng.normal(0.0, 3.0, size=(32, K)).astype(np.float32)
            ok = rng.random((32, K)) < np.where(x > 0.0, 0.95, 0.3)
            a = np.where(ok.all(axis=1), K, np.argmin(ok, axis=1)).astype(np.int32)
            fwd.submit(x, np.full(32, K, dtype=np.int32), a, None)
        assert fwd.flush(30)
        version = client.coefficients(reg.pair_id).version
        deadline = time.monotonic() + 20
        while getattr(fwd.latest_coefficients(), "version", 0) != version:
            assert time.monotonic() < deadline, "the primer never saw the latest version"
            time.sleep(0.01)
        table = fwd.latest_calibration()
        fwd.close()
    assert table is not None and table[2], "the layer is not served after priming"
    return reg.pair_id, table


def test_the_served_calibration_table_inside_vllms_real_predict(python, start_sidecar, tmp_path):
    live = start_sidecar(tmp_path / "live", refit_interval=SIDECAR_REFIT, default_rule="vllm")
    pair_id, table = prime_served_layer(live.grpc_address)
    got = drive(python, live.grpc_address, "summary", tmp_path, steps=TABLE_STEPS)
    assert got["torch"].startswith("2.13.0") and got["pair_id"] == pair_id
    checks = got["table_checks"]
    assert len(checks) == TABLE_STEPS
    # the first drafts precede the first step boundary, where the shim loads the table
    # pushed with the warm start: from the second step on vLLM's predict serves it
    assert not checks[0]["served"] and checks[1]["served"]
    np.testing.assert_allclose(checks[1]["table"][0], table[0], rtol=1e-6)
    np.testing.assert_allclose(checks[1]["table"][1], table[1], rtol=1e-6, atol=1e-6)
    # what adaptive verification reads is the table's map of vLLM's linear confidences
    # (and the linear confidences themselves at any step where the table is not served)
    assert max(c["err"] for c in checks) <= 1e-6, [c["err"] for c in checks]
    served = [c for c in checks if c["served"]]
    assert len(served) >= TABLE_STEPS // 2
    assert max(c["bend"] for c in served) > 0.05  # the table moved vLLM's confidences
    # CUDA-graph safe: no host synchronisation, one op and shape sequence per batch size
    ops = got["table_ops"]
    assert ops["calls"] == TABLE_STEPS * K
    assert ops["host_syncs"] == [] and ops["max_sequences_per_size"] == 1, ops


def test_a_mixed_batch_with_strata_on_vllms_real_classes(python, start_sidecar, tmp_path):
    """AVEST_STRATA=1 in summary mode, half the requests greedy and half at T = 0.8: the
    sidecar receives one round summary per stratum, fits both and pushes their sets
    back; the strata's drafts add up to the pair's (every slot has a stratum)."""
    live = start_sidecar(tmp_path / "live", refit_interval=SIDECAR_REFIT, default_rule="vllm")
    got = drive(python, live.grpc_address, "summary", tmp_path, AVEST_STRATA="1")
    st = got["stats"]
    assert st["governed"] and got["local_refits"] == 0
    assert sorted(st["strata"]["names"]) == ["greedy", "t0.5-1"]
    strata = httpx.get(f"{live.http_url}/v1/pairs/{got['pair_id']}/strata", timeout=10).json()
    by_name = {s["stratum"]: s for s in strata["strata"]}
    assert set(by_name) == {"greedy", "t0.5-1"}
    assert all(s["drafts"] > 0 and s["rounds"] >= 1 for s in by_name.values())
    with EstimatorClient(live.grpc_address) as client:
        pair = client.pair(got["pair_id"])
    assert sum(s["drafts"] for s in by_name.values()) == pair.drafts_observed
    assert strata["fallback_rows"] == 0
    # the sidecar's sets came back and govern predict at the end
    assert sorted(n for n in st["strata_in_force"] if n) == ["greedy", "t0.5-1"]
