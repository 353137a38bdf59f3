"""The shim's life in a worker (avest_client.vllm.lifecycle): the last round at the
worker's shutdown, and a worker that builds no estimator.

vLLM's worker class is stood in for by a class with the two methods the hooks wrap
(``load_model``, ``shutdown``); the estimator is the CPU stand-in under the real shim
with a real sidecar sink and server. ``tests/engine`` checks the same inside a whole
vLLM engine whose core runs in a subprocess.
"""

from __future__ import annotations

import logging
import types

import prometheus_client
import pytest

from avest_client import EstimatorClient
from avest_client.vllm import lifecycle
from tests.support.sidecar import make_shim, sink_of
from tests.support.tracedrive import drive, trace_steps


class Worker:
    """The shape of vLLM's ``Worker``: builds its model runner, then is shut down."""

    def __init__(self, build) -> None:  # noqa: ANN001
        self.build = build
        self.estimator = None
        self.calls: list[str] = []

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        self.calls.append("load_model")
        self.estimator = self.build()

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture
def worker_module(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setattr(lifecycle, "_built", 0)
    monkeypatch.setattr(lifecycle, "_warned", False)
    cls = type("Worker", (Worker,), {})
    module = types.SimpleNamespace(Worker=cls)
    lifecycle.install_worker_hooks(module)  # type: ignore[arg-type]
    lifecycle.install_worker_hooks(module)  # type: ignore[arg-type]  # idempotent
    return module


def test_the_open_round_is_sent_when_the_worker_shuts_down(
    start_sidecar, tmp_path, trace_slice, worker_module
):
    srv = start_sidecar(tmp_path, refit_interval=1000, default_rule="vllm")
    steps = 130  # one whole round of vLLM's 100 steps and an open one of 29 after the first
    worker = worker_module.Worker(lambda: make_shim(srv.grpc_address, mode="summary"))
    worker.load_model()
    est = worker.estimator
    assert sink_of(est).wait_connected(10)
    for s in trace_steps(trace_slice("chat", 0, steps)):
        drive(est, s)
    pair_id = sink_of(est).pair_id
    worker.shutdown()
    assert worker.calls == ["load_model", "shutdown"]
    with EstimatorClient(srv.grpc_address) as client:
        pair = client.pair(pair_id)
    # every step after the one that applied the pooled coefficients, the open round too
    assert pair.steps_observed == steps - 1
    assert est._avest.closed
    est.avest_close()  # a second close does nothing
    assert lifecycle.close_all() == 0


def test_a_worker_that_builds_no_estimator_says_so_once(worker_module, caplog):
    caplog.set_level(logging.WARNING, logger=lifecycle.__name__)
    for _ in range(2):
        worker = worker_module.Worker(lambda: None)
        worker.load_model()
    warnings = [r for r in caplog.records if "built no acceptance estimator" in r.getMessage()]
    assert len(warnings) == 1
    assert "VLLM_USE_V2_MODEL_RUNNER" in warnings[0].getMessage()
    assert prometheus_client.REGISTRY.get_sample_value("avest_shim_no_estimator") == 1.0


def test_a_worker_with_an_estimator_says_nothing(start_sidecar, tmp_path, worker_module, caplog):
    srv = start_sidecar(tmp_path)
    caplog.set_level(logging.WARNING, logger=lifecycle.__name__)
    worker = worker_module.Worker(lambda: make_shim(srv.grpc_address, mode="summary"))
    worker.load_model()
    assert lifecycle.built() == 1
    assert not [r for r in caplog.records if "built no" in r.getMessage()]
    worker.shutdown()
    assert worker.estimator._avest.closed


def test_the_engine_core_closes_its_workers_estimators_before_stopping_them(
    start_sidecar, tmp_path, trace_slice, monkeypatch
):
    """vLLM's engine core asks each worker, through ``collective_rpc`` (the callable is
    pickled and run as ``func(worker)`` in the worker's process), to close its estimators
    while the workers still serve RPCs; then its own shutdown stops the executor."""
    import pickle

    srv = start_sidecar(tmp_path, refit_interval=1000, default_rule="vllm")
    est = make_shim(srv.grpc_address, mode="summary")
    assert sink_of(est).wait_connected(10)
    for s in trace_steps(trace_slice("chat", 0, 30)):
        drive(est, s)
    events: list[str] = []

    class Executor:
        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):  # noqa: ANN001, ANN202
            fn = pickle.loads(pickle.dumps(method))  # by reference, as vLLM's workers get it
            events.append(f"rpc closed {fn('worker')}")

        def shutdown(self) -> None:
            events.append("executor shutdown")

    class EngineCore:
        def __init__(self) -> None:
            self.model_executor = Executor()

        def shutdown(self) -> None:
            self.model_executor.shutdown()

    module = types.SimpleNamespace(EngineCore=EngineCore)
    lifecycle.install_engine_hooks(module)  # type: ignore[arg-type]
    lifecycle.install_engine_hooks(module)  # type: ignore[arg-type]  # idempotent
    pair_id = sink_of(est).pair_id
    EngineCore().shutdown()
    assert events == ["rpc closed 1", "executor shutdown"]
    with EstimatorClient(srv.grpc_address) as client:
        assert client.pair(pair_id).steps_observed == 29
