"""The shim over a real :class:`SidecarSink`, driven by recorded traces.

The stand-in estimator (:mod:`tests.support.standin`) wrapped by the shim, its sink
talking to a real sidecar (an in-process server or an older release); the steps that
drive it are :mod:`tests.support.tracedrive`'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from avest_client import Backoff
from avest_client.vllm import costs
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_client.vllm.sidecar.sink import SidecarSink
from avest_wire.pair import PairKey
from tests.support import helpers
from tests.support.standin import StandinAcceptanceEstimator
from tests.support.tracedrive import MAX_REQS

CPU = torch.device("cpu")
TARGET = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized fp32)"
DRAFT = "SmolLM2-135M-Instruct RTN 4-bit group 32"
METHOD = "draft_model"
LABELS = (("temperature", "1.0"),)
#: Reconnect quickly in tests (production: 50 ms doubling to 5 s).
FAST = Backoff(initial_s=0.02, max_s=0.3)
DRAFT_CURVE = [(1, 1.0), (64, 1.5), (256, 3.0)]
VERIFY_CURVE = [(1, 5.0), (64, 6.0), (256, 9.0), (1024, 20.0)]


def make_shim(
    address: str,
    *,
    queue_size: int = 4096,
    timeout_s: float = 5.0,
    hardware: str = "test-gpu",
    recorder: costs.CostCurveRecorder | None = None,
    k: int = 5,
    base: type = StandinAcceptanceEstimator,
    mode: str = "raw",
):
    """A stand-in estimator wrapped by the shim over a real :class:`SidecarSink`."""
    cfg = ShimConfig(
        address=address, timeout_s=timeout_s, queue_size=queue_size, labels=LABELS,
        hardware=hardware, mode=mode,
    )  # fmt: skip
    rec = recorder if recorder is not None else costs.CostCurveRecorder()

    def factory(config: ShimConfig, pair_key: PairKey) -> SidecarSink:
        return SidecarSink(config, pair_key, recorder=rec, backoff=FAST)

    cls = make_sidecar_estimator(
        base,
        factory,
        config=cfg,
        pair_resolver=lambda kk: PairKey(
            TARGET, DRAFT, METHOD, kk, {**dict(LABELS), "draft_sample_method": "probabilistic"}
        ),
    )
    return cls(MAX_REQS, k, CPU)


def sink_of(est) -> SidecarSink:  # noqa: ANN001
    sink = est._avest.sink
    assert isinstance(sink, SidecarSink)
    return sink


def delivered(est, timeout: float = 20.0) -> None:  # noqa: ANN001
    """Everything stepped so far is acknowledged by the sidecar."""
    assert est._avest.transfer.flush(timeout)
    assert sink_of(est).flush(timeout), sink_of(est).stats


def wait_until(pred: Callable[[], bool], timeout: float = 15.0, what: str = "") -> None:
    """:func:`tests.support.helpers.wait_until` that fails the test when time runs out."""
    if not helpers.wait_until(pred, timeout, interval=0.005):
        raise AssertionError(f"timed out waiting for {what or pred}")
