"""In-memory stand-ins for the network side: a Sink and its factory."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class Submitted:
    features: np.ndarray
    num_verified: np.ndarray
    num_accepted: np.ndarray
    exclude: np.ndarray | None
    strata: list[str] | None = None


class FakeSink:
    """Records what it receives. ``connected``/coefficients are set by the test.

    ``delay_s`` makes each submit slow; ``gate`` (an Event) blocks submit until set.
    """

    def __init__(
        self,
        connected: bool = True,
        delay_s: float = 0.0,
        gate: threading.Event | None = None,
        fail: bool = False,
    ) -> None:
        self._lock = threading.Lock()
        self.received: list[Submitted] = []
        self.summaries: list = []
        #: Each summary's stratum (None: the worker's pooled round), beside ``summaries``.
        self.summary_strata: list[str | None] = []
        #: What ``latest_strata()`` returns (name -> Served); None: the sink has none.
        self.strata: dict | None = None
        self.is_connected = connected
        self.coefficients: tuple[int, float, list[float]] | None = None
        self.delay_s = delay_s
        self.gate = gate
        self.fail = fail
        self.entered = threading.Event()
        self.closed = False
        self.reads = 0

    # Sink protocol ----------------------------------------------------------
    def submit(self, features, num_verified, num_accepted, exclude, strata=None) -> None:  # noqa: ANN001
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.fail:
            raise RuntimeError("sink down")
        with self._lock:
            self.received.append(Submitted(features, num_verified, num_accepted, exclude, strata))

    def submit_summary(self, summary, stratum=None) -> None:  # noqa: ANN001
        if self.fail:
            raise RuntimeError("sink down")
        with self._lock:
            self.summaries.append(summary)
            self.summary_strata.append(stratum)

    def latest_strata(self):  # noqa: ANN201
        return self.strata

    def latest_coefficients(self):  # noqa: ANN201
        self.reads += 1
        return self.coefficients

    @property
    def connected(self) -> bool:
        return self.is_connected

    def close(self, timeout: float | None = None) -> None:
        self.closed = True

    # test helpers -------------------------------------------------------------
    def push(self, version: int, slope: float, intercepts) -> None:  # noqa: ANN001
        self.coefficients = (version, float(slope), [float(b) for b in intercepts])

    def snapshot(self) -> list[Submitted]:
        with self._lock:
            return list(self.received)


class FakeSinkFactory:
    def __init__(self, sink: FakeSink | None = None, error: Exception | None = None) -> None:
        self.sink = sink if sink is not None else FakeSink()
        self.error = error
        self.calls: list[tuple[object, object]] = []

    def __call__(self, config, pair_key):  # noqa: ANN001, ANN204
        self.calls.append((config, pair_key))
        if self.error is not None:
            raise self.error
        return self.sink
