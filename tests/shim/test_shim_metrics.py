"""The shim's counters as Prometheus metrics in the worker process, multiprocess-safe:
written under PROMETHEUS_MULTIPROC_DIR by the worker, merged by a collector elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

WORKER = textwrap.dedent(
    """
    import sys, torch
    sys.path[:0] = [sys.argv[1]]
    from tests.shim.fakes import FakeSink, FakeSinkFactory
    from tests.support.standin import StandinAcceptanceEstimator
    from tests.support.tracedrive import drive, steps, synthetic_trace
    from avest_client.vllm.config import ShimConfig
    from avest_client.vllm.estimator import make_sidecar_estimator

    mode = sys.argv[2]
    sink = FakeSink()
    sink.push(7, 0.6, [0.1] * 4)
    # a queue that holds every step: a starved forwarder thread drops none (exact counts)
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator,
        FakeSinkFactory(sink),
        config=ShimConfig(mode=mode, queue_size=4096),
    )
    est = cls(32, 4, torch.device("cpu"))
    rounds = est._avest.rounds

    def run(trace):
        # Summary mode: the sender hands each closed round to the sink before the next
        # step, so no round finds both buffer sets still held on a busy machine (that
        # skip is tested on purpose in test_shim_summary.py).
        for s in steps(trace, 32):
            closed = rounds.closed_rounds if rounds is not None else 0
            drive(est, s)
            if rounds is not None and rounds.closed_rounds != closed:
                assert rounds.flush(10), "the sender did not hand the round over"

    run(synthetic_trace(steps=250, batch=8, k=4))
    sink.is_connected = False  # lost: local refits resume
    run(synthetic_trace(steps=120, batch=8, k=4, seed=1))
    if rounds is not None:
        assert rounds.flush(10)
    if est._avest.transfer is not None:
        assert est._avest.transfer.flush(10)
    est.avest_close()  # the exporter's last update
    """
)


def _run_worker(tmp_path: Path, mode: str) -> dict[str, dict[tuple, float]]:
    mdir = tmp_path / f"prom-{mode}"
    mdir.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(mdir))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "service"), str(ROOT / "client"), str(ROOT / "wire"), env.get("PYTHONPATH", "")]
    )
    subprocess.run(
        [sys.executable, "-c", WORKER, str(ROOT), mode], env=env, check=True, timeout=120
    )
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mdir))
    out: dict[str, dict[tuple, float]] = {}
    for fam in reg.collect():
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "pid"))
            out.setdefault(s.name, {})[labels] = s.value
    return out


def test_summary_mode_counters_reach_the_multiprocess_directory(tmp_path):
    m = _run_worker(tmp_path, "summary")
    assert m["avest_shim_info"][(("mode", "summary"),)] == 1
    assert m["avest_shim_coefficients_version"][()] == 7
    assert m["avest_shim_pooled"][()] == 0  # lost at the end
    assert m["avest_shim_summaries_total"][()] == 3  # 100 + 100 + the round cut by the loss
    assert m["avest_shim_steps_forwarded_total"][()] == 0  # nothing per step
    assert m["avest_shim_local_refits_total"][()] == 1  # after the loss
    assert m["avest_shim_skipped_refits_total"][()] == 2
    # fresh tensors every step: kept by reference, every round with its sketch
    assert m["avest_shim_copy_mode"][()] == 0
    assert m["avest_shim_sketches_skipped_total"][()] == 0
    assert m["avest_shim_strata_rounds_pooled_total"][()] == 0  # no strata
    assert m["avest_shim_reached_skipped_total"][()] == 0


def test_raw_mode_counts_forwarded_steps(tmp_path):
    m = _run_worker(tmp_path, "raw")
    assert m["avest_shim_info"][(("mode", "raw"),)] == 1
    assert m["avest_shim_steps_forwarded_total"][()] == 370
    assert m["avest_shim_summaries_total"][()] == 0
