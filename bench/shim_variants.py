"""The variants bench/bench_shim.py times: vLLM's estimator (the CPU stand-in) plain or
wrapped by the avest shim with an in-memory sink or the real SidecarSink against a real
sidecar (healthy, absent or slow) in a subprocess; and the step inputs they are fed."""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from serve_proc import serve  # first: it puts the repository root on the path (tests)

from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_client.vllm.sidecar.sink import SidecarSink
from avest_wire.pair import PairKey
from tests.support.standin import StandinAcceptanceEstimator

SLOW_S = 0.5
CPU = torch.device("cpu")

#: ``avest serve`` with every Observe message handled SLOW_S after it arrives.
SLOW_SERVER = f"""
import asyncio, sys
import avest.server
from avest.grpc.service import EstimatorService

class SlowObserve(EstimatorService):
    async def Observe(self, request_iterator, context):
        async def slow():
            async for req in request_iterator:
                await asyncio.sleep({SLOW_S})
                yield req
        async for resp in super().Observe(slow(), context):
            yield resp

avest.server.EstimatorService = SlowObserve
from avest.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


class BenchSink:
    """Counts what it gets; optionally slow. Mirrors the Sink protocol."""

    def __init__(self, connected: bool, delay_s: float = 0.0, k: int = 8) -> None:
        self._connected = connected
        self.delay_s = delay_s
        self.rows = 0
        self.calls = 0
        self._coef = (1, 0.55, [0.4 - 0.1 * i for i in range(k)]) if connected else None

    def submit(self, features, num_verified, num_accepted, exclude) -> None:  # noqa: ANN001
        if self.delay_s:
            time.sleep(self.delay_s)
        self.rows += features.shape[0]
        self.calls += 1

    def latest_coefficients(self):  # noqa: ANN201
        return self._coef

    @property
    def connected(self) -> bool:
        return self._connected

    def close(self) -> None:
        pass


# -- a real sidecar in a subprocess -------------------------------------------------


class Sidecar:
    """``avest serve`` (or its slow variant) on 127.0.0.1:0 with a fresh data directory."""

    def __init__(self, slow: bool = False) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="avest-bench-")
        served = serve(
            Path(self._dir.name),
            ["--log-level", "warning"],
            tokens=False,
            command=[sys.executable, "-c", SLOW_SERVER] if slow else None,
        )
        self.proc, self.address = served.proc, served.grpc_address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._dir.cleanup()


def unused_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


# -- the estimators ------------------------------------------------------------------


def make_inputs(batch: int, k: int, seed: int = 0):
    """Eight steps of valid verdicts: accepted a <= K, a + rejected <= K."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(batch, generator=g).to(torch.int64)
    feats = [(torch.randn(batch, k, generator=g) * 2 + 1).clamp_(-40, 40) for _ in range(8)]
    sampled, rejected = [], []
    for _ in range(8):
        s = torch.randint(0, k + 2, (batch,), generator=g, dtype=torch.int32)
        a = (s - 1).clamp(min=0)
        r = torch.randint(0, 2, (batch,), generator=g, dtype=torch.int32)
        sampled.append(s)
        rejected.append(torch.minimum(r, k - a).to(torch.int32))
    return idx, feats, sampled, rejected


def shim_class(
    sink_factory: Callable[[ShimConfig, PairKey], Any], address: str, queue: int, k: int
):
    cls = make_sidecar_estimator(
        StandinAcceptanceEstimator,
        sink_factory,
        config=ShimConfig(address=address, queue_size=queue, hardware="bench", mode="raw"),
        pair_resolver=lambda kk: PairKey("bench-target", "bench-draft", "draft_model", kk),
    )
    return cls


def make_variant(kind: str, batch: int, k: int, queue: int) -> tuple[Any, Callable[[], None]]:
    """``(estimator, cleanup)`` for one variant."""
    if kind == "vLLM alone (A/A)":
        return StandinAcceptanceEstimator(batch, k, CPU), lambda: None
    if kind.startswith("in-memory"):
        sink = {
            "in-memory: healthy": lambda: BenchSink(True, k=k),
            "in-memory: absent": lambda: BenchSink(False, k=k),
            "in-memory: slow (500 ms)": lambda: BenchSink(True, delay_s=SLOW_S, k=k),
        }[kind]()
        est = shim_class(lambda config, pair: sink, "bench", queue, k)(batch, k, CPU)
        return est, est.avest_close
    sidecar = None
    if kind == "sidecar: absent":
        address = unused_address()
    else:
        sidecar = Sidecar(slow=kind.startswith("sidecar: slow"))
        address = sidecar.address

    def factory(config: ShimConfig, pair: PairKey) -> SidecarSink:
        return SidecarSink(config, pair, recorder=costs.CostCurveRecorder())

    est = shim_class(factory, address, queue, k)(batch, k, CPU)
    if sidecar is not None and not est._avest.sink.wait_connected(30):
        raise RuntimeError(f"{kind}: the sink did not connect")

    def cleanup() -> None:
        est.avest_close()
        if sidecar is not None:
            sidecar.stop()

    return est, cleanup


KINDS = [
    "vLLM alone (A/A)",
    "in-memory: healthy",
    "in-memory: absent",
    "in-memory: slow (500 ms)",
    "sidecar: healthy",
    "sidecar: absent",
    "sidecar: slow (500 ms)",
]
