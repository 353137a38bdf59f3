"""Session fixtures for the deploy tests: one real avest service fed with the
bundled sample trace, the demo's simulated vLLM counters, and (when the
Debian package is installed) one real Prometheus server scraping both with the
stack's alert rules loaded."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.serve import Served, serve

from .harness import (
    ALERTS,
    HARDWARE,
    PROMETHEUS_HINT,
    STRATA,
    Fed,
    Prometheus,
    feed_sample_trace,
    free_port,
    prometheus_config,
    require_tool,
    start_prometheus,
    start_vllm_sim,
    stop_process,
)


@dataclass
class LiveAvest:
    service: Served
    fed: Fed
    vllm_sim_url: str


@pytest.fixture(scope="session")
def live_avest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveAvest]:
    """``avest serve`` on free loopback ports with the sample trace observed
    (2 workers, refit every 10 steps, its rows in two strata, one refused
    request, a schedule asked for), plus the simulated
    vLLM counters of the same trace on another port."""
    data = tmp_path_factory.mktemp("avest-data")
    service = serve(data, "--refit-interval", "10", "--flush-interval-ms", "20")
    sim = None
    try:
        sim_port = free_port()
        sim = start_vllm_sim(sim_port)
        fed = feed_sample_trace(
            service.grpc_address,
            workers=2,
            refit_interval=10,
            strata=STRATA,
            schedule=HARDWARE,
        )
        yield LiveAvest(service, fed, f"http://127.0.0.1:{sim_port}")
    finally:
        if sim is not None:
            stop_process(sim)
        service.stop()


@dataclass
class LivePrometheus:
    prometheus: Prometheus
    avest: LiveAvest


@pytest.fixture(scope="session")
def live_prometheus(
    live_avest: LiveAvest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LivePrometheus]:
    """A real Prometheus (1 s scrapes, deploy/prometheus/alerts.yml loaded)
    scraping the live avest as job "avest" and the simulated vLLM as job "vllm",
    returned once both have been scraped a few times with the fed data."""
    binary = require_tool("prometheus", PROMETHEUS_HINT)
    workdir: Path = tmp_path_factory.mktemp("prometheus")
    avest_target = live_avest.service.http_url.removeprefix("http://")
    vllm_target = live_avest.vllm_sim_url.removeprefix("http://")
    config = prometheus_config(avest_target, vllm_target, ALERTS)
    prom = start_prometheus(binary, workdir, config)
    try:
        # Once Prometheus has scraped the service, stream the trace again as
        # other workers, so the counters move between scrapes (rates above 0).
        # A wait, not a timing claim: a busy machine may take long to start Prometheus
        # and for three scrapes to follow.
        deadline = time.monotonic() + 120
        while not prom.query('up{job="avest"} == 1')["data"]["result"]:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Prometheus never scraped avest:\n{prom.log.read_text()[-4000:]}"
                )
            time.sleep(0.25)
        feed_sample_trace(
            live_avest.service.grpc_address, worker_prefix="deploy-test-again", strata=STRATA
        )
        want = 2 * live_avest.fed.steps
        # The fed pair's own series: other tests feed other pairs of the same
        # service, and one of theirs may pass the count first.
        fed = f'avest_steps_observed_total{{job="avest",pair="{live_avest.fed.pair_id}"}}'
        while True:
            r = prom.query(f"count_over_time({fed}[1m]) >= 3 and {fed} >= {want}")
            v = prom.query(
                'count_over_time(vllm:spec_decode_num_drafts_total{job="vllm"}[1m]) >= 3'
            )
            if r.get("data", {}).get("result") and v.get("data", {}).get("result"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "Prometheus has not stored the fed avest data and vLLM's counters under "
                    "their documented names (for vLLM: see metric_relabel_configs in "
                    f"deploy/prometheus/prometheus.yml): {r} {v}\n{prom.log.read_text()[-4000:]}"
                )
            time.sleep(0.25)
        yield LivePrometheus(prom, live_avest)
    finally:
        stop_process(prom.proc)
