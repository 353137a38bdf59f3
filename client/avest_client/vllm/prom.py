"""The shim's counters as Prometheus metrics in vLLM's own process, next to vLLM's.

vLLM exports its metrics with ``prometheus_client`` (a dependency of vLLM, so
the shim adds none: without it this module does nothing). The shim's metrics
go to the same default registry. With ``PROMETHEUS_MULTIPROC_DIR`` set (vLLM
sets it up when several processes serve metrics; set it yourself so that the
worker processes' values reach vLLM's ``/metrics``), ``prometheus_client``
writes every process's values to files in that directory and vLLM's exporter
merges them: counters are summed over the processes, gauges are kept per
process (``pid`` label, ``liveall``: a dead worker's series disappear).

Nothing runs on the decode step: an ``avest-metrics`` daemon thread reads the
shim's counters (plain attribute reads) every ``interval_s`` and moves the
metrics by the difference.

=========================================  =======  ========================================
metric                                     type     meaning
=========================================  =======  ========================================
``avest_shim_info{mode}``                  gauge    1; ``summary`` or ``raw``
``avest_shim_coefficients_version``        gauge    version of the pooled coefficients applied
                                                    (-1: none yet, vLLM's own)
``avest_shim_pooled``                      gauge    1 while pooled coefficients govern
``avest_shim_sidecar_connected``           gauge    1 while the sidecar is reachable
``avest_shim_copy_mode``                   gauge    1 once the shim copies each step's vectors
                                                    (the caller reuses its buffers)
``avest_shim_no_estimator``                gauge    1: the plugin is active but this worker built
                                                    no estimator (AV off, or vLLM's V1 runner)
``avest_shim_steps_forwarded_total``       counter  raw steps handed to the sidecar's queue
``avest_shim_summaries_total``             counter  round summaries handed to it
``avest_shim_dropped_total``               counter  steps or summaries dropped unsent
``avest_shim_stalls_total``                counter  times the sidecar stopped acknowledging
``avest_shim_local_refits_total``          counter  vLLM's own refits (sidecar absent)
``avest_shim_skipped_refits_total``        counter  local refits skipped while pooled
``avest_shim_sketches_skipped_total``      counter  round summaries sent without a sketch
``avest_shim_strata_rounds_pooled_total``  counter  strata: rounds sent as one pooled summary
                                                    (not summed per stratum)
``avest_shim_reached_skipped_total``       counter  rounds whose reached counts failed their
                                                    check (sent without them)
=========================================  =======  ========================================
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Counters: metric name -> how to read its running total from the shim's stats.
COUNTERS: dict[str, Callable[[dict[str, Any]], int]] = {
    "avest_shim_steps_forwarded": lambda s: int(s.get("submitted") or 0),
    "avest_shim_summaries": lambda s: int(s.get("summaries") or 0),
    "avest_shim_dropped": lambda s: (
        int(s.get("dropped") or 0) + int((s.get("sink") or {}).get("dropped") or 0)
    ),
    "avest_shim_stalls": lambda s: int((s.get("sink") or {}).get("stalls") or 0),
    "avest_shim_local_refits": lambda s: int(s.get("local_refits") or 0),
    "avest_shim_skipped_refits": lambda s: int(s.get("skipped_refits") or 0),
    "avest_shim_sketches_skipped": lambda s: int(s.get("sketches_skipped") or 0),
    "avest_shim_strata_rounds_pooled": lambda s: int(s.get("strata_rounds_pooled") or 0),
    "avest_shim_reached_skipped": lambda s: int(s.get("reached_skipped") or 0),
}
_HELP = {
    "avest_shim_steps_forwarded": "Raw decode steps the avest shim handed to the sidecar's queue.",
    "avest_shim_summaries": "Round summaries the avest shim handed to the sidecar's queue.",
    "avest_shim_dropped": "Steps or summaries the avest shim dropped unsent (queues full).",
    "avest_shim_stalls": "Times the sidecar stopped acknowledging while work was outstanding.",
    "avest_shim_local_refits": "vLLM's own estimator refits (pooled coefficients not governing).",
    "avest_shim_skipped_refits": "Local refits skipped because pooled coefficients govern.",
    "avest_shim_sketches_skipped": "Round summaries sent without a calibration sketch.",
    "avest_shim_strata_rounds_pooled": (
        "Rounds sent as one pooled summary of vLLM's sums, not summed per stratum."
    ),
    "avest_shim_reached_skipped": (
        "Rounds whose reached counts failed their check and were sent without them."
    ),
}

_lock = threading.Lock()
_metrics: dict[str, Any] | None = None


def _build() -> dict[str, Any] | None:
    """The metric objects, once per process; None without prometheus_client."""
    global _metrics
    with _lock:
        if _metrics is not None:
            return _metrics
        try:
            from prometheus_client import Counter, Gauge
        except ImportError:
            return None
        g = dict(multiprocess_mode="liveall")
        out: dict[str, Any] = {
            "info": Gauge("avest_shim_info", "Always 1; the avest shim's mode.", ["mode"], **g),
            "version": Gauge(
                "avest_shim_coefficients_version",
                "Version of the pooled coefficients the avest shim applied (-1: none).",
                **g,
            ),
            "pooled": Gauge(
                "avest_shim_pooled", "1 while the sidecar's pooled coefficients govern.", **g
            ),
            "connected": Gauge(
                "avest_shim_sidecar_connected", "1 while the avest sidecar is reachable.", **g
            ),
            "copy_mode": Gauge(
                "avest_shim_copy_mode",
                "1 once the avest shim copies each step's vectors (the caller reuses them).",
                **g,
            ),
            "no_estimator": Gauge(
                "avest_shim_no_estimator",
                "1: the avest plugin is active but this worker built no acceptance estimator "
                "(adaptive verification off, or vLLM's V1 model runner); nothing is sent.",
                **g,
            ),
        }
        for name in COUNTERS:
            out[name] = Counter(name, _HELP[name])
        _metrics = out
        return out


def mark_no_estimator() -> None:
    """``avest_shim_no_estimator`` = 1 in this process (see :mod:`avest_client.vllm.lifecycle`)."""
    m = _build()
    if m is not None:
        m["no_estimator"].set(1)


class Exporter:
    """Moves the shim's metrics from its stats every ``interval_s`` (daemon thread)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], interval_s: float = 1.0) -> None:
        self._stats = stats
        self._interval = interval_s
        self._last: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._stop = threading.Event()
        self.metrics = _build()
        self._thread: threading.Thread | None = None
        if self.metrics is not None:
            self._thread = threading.Thread(target=self._run, name="avest-metrics", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.update()

    def update(self) -> None:
        """Read the stats once and move the metrics (also called at close)."""
        m = self.metrics
        if m is None:
            return
        try:
            s = self._stats()
        except Exception:  # noqa: BLE001 - metrics never fail the worker
            logger.debug("avest: reading the shim's stats failed", exc_info=True)
            return
        if not s:
            return
        m["info"].labels(str(s.get("mode", ""))).set(1)
        version = s.get("version")
        m["version"].set(-1 if version is None else int(version))
        m["pooled"].set(1 if s.get("governed") else 0)
        sink = s.get("sink") or {}
        m["connected"].set(1 if sink.get("connected") else 0)
        m["copy_mode"].set(1 if s.get("copy_mode") else 0)
        for name, read in COUNTERS.items():
            now = read(s)
            if now > self._last[name]:
                m[name].inc(now - self._last[name])
            self._last[name] = max(now, self._last[name])

    def close(self) -> None:
        self._stop.set()
        self.update()
