"""The shim folder's fixtures.

The shim's tests run it as an operator would with cost curves on: holding the admin
token of the test servers (``SetCostCurves`` is an admin action).
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator

import pytest

from avest_client.vllm import contract, costs, exclusion
from avest_client.vllm import sketch as sketches
from tests.support.server import ADMIN_TOKEN, ServerHandle
from tests.support.standin import StandinAcceptanceEstimator


@pytest.fixture
def held_sender(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``(entered, release)``: the rounds' sender holds in its first ``sketch.build``
    (a round's sketch, or its per-stratum sums) once ``entered`` is set, until the test
    sets ``release`` (set at teardown in any case)."""
    build, entered, release = sketches.build, threading.Event(), threading.Event()

    def held_once(*args: object, **kwargs: object) -> object:
        if not entered.is_set():
            entered.set()
            assert release.wait(30), "the test never released the sender"
        return build(*args, **kwargs)

    monkeypatch.setattr(sketches, "build", held_once)
    yield entered, release
    release.set()


@pytest.fixture(autouse=True)
def _shim_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AVEST_TOKEN", ADMIN_TOKEN)


@pytest.fixture
def start_sidecar(start_server: Callable[..., ServerHandle]) -> Callable[..., ServerHandle]:
    """``start(data_dir, **settings)`` -> a real sidecar on free ports, stopped at the end."""
    return start_server


class _FakeSampler:
    def __init__(self) -> None:
        self.added: list[int] = []

    def add_request(self, req_idx: int, sampling_params: object) -> None:
        self.added.append(req_idx)


class _FakeManager:
    _cudagraph_limit = 0

    def set_cost_curves(self, draft_curve: object, verify_curve: object) -> None:
        self.tables = (draft_curve, verify_curve)


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The three vLLM modules the plugin hooks, as already-imported fakes, and the
    plugin's environment (a sidecar address, one label)."""
    spec_mod = types.ModuleType(contract.SPECULATOR_MODULE)
    spec_mod.OnlineAcceptanceEstimator = StandinAcceptanceEstimator  # type: ignore[attr-defined]
    sampler_mod = types.ModuleType(contract.SAMPLER_MODULE)
    sampler_mod.Sampler = type("Sampler", (_FakeSampler,), {})  # type: ignore[attr-defined]
    av_mod = types.ModuleType(contract.ADAPTIVE_VERIFICATION_MODULE)
    av_mod.AdaptiveVerificationManager = type(  # type: ignore[attr-defined]
        "AdaptiveVerificationManager", (_FakeManager,), {}
    )
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    for m in (spec_mod, sampler_mod, av_mod):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    monkeypatch.setattr(exclusion.REGISTRY, "active", False)
    monkeypatch.setattr(costs, "RECORDER", costs.CostCurveRecorder())
    monkeypatch.setenv("AVEST_ADDRESS", "127.0.0.1:7070")
    monkeypatch.setenv("AVEST_LABELS", "temp=1.0")
    return types.SimpleNamespace(spec=spec_mod, sampler=sampler_mod, av=av_mod)
