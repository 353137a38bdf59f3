"""Summary mode in the worker: one round summary per round, nothing per step on the host.

vLLM's estimator already sums each round's IRLS statistics on the device
(``info`` [K, 3], ``grad`` [K, 2], ``counts`` [K]) at the coefficients its
draft graph used. In summary mode the shim sends those sums once per round,
with the coefficients (and sidecar version) they were computed at, the
number of steps and a calibration sketch, instead of every step's drafts.

Per step (vLLM's thread, only while pooled coefficients govern):

* :meth:`SummaryRound.sketch` adds the step's drafts to the calibration
  sketch with fixed-shape torch ops on the estimator's device: the linear
  predictor ``eta = slope x + b_k`` of every (request, position) from the
  features and the coefficients the draft graph read, its AUC slot (1024
  bins on [-12, 12) plus two edge slots) by label, its ECE bin (15
  probability bins) with the probability and the log loss, all masked by
  the observed flag and added with ``index_add_``. No host copy, no
  synchronisation, no Python loop over requests.
* the step count is incremented.

At a round boundary (``REFIT_INTERVAL`` steps, a coefficient update, or the
sidecar lost) :meth:`SummaryRound.end` concatenates the sums and the sketch
into one device buffer, starts its copy to the host (pinned, non-blocking on
CUDA), zeroes the device sums and hands the buffer to a sender thread, which
waits for that copy only and gives the sink a
:class:`~avest_client.summary.RoundSummaryData`.

A round only ever holds steps drafted with one set of pooled coefficients:
it starts at the first step whose drafts were scored with coefficients from
the sidecar and ends before different ones apply. Rounds run under vLLM's own
local refits (sidecar absent) are not sent; vLLM refits on them as usual.

Exclusion flags do not apply in summary mode: the sums are vLLM's own, which
include every request.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from avest_client.summary import AUC_SLOTS, ECE_BINS, ETA_RANGE, RoundSummaryData, Sketch

logger = logging.getLogger(__name__)

_SCALE = (AUC_SLOTS - 2) / (2.0 * ETA_RANGE)
_OFFSET = ETA_RANGE * _SCALE + 1.0


@dataclass
class _Pending:
    """A round handed to the sender: its host buffer and what it was computed at."""

    host: torch.Tensor
    ready: Any  # CUDA event, or None on CPU
    version: int
    slope: float
    intercepts: tuple[float, ...]
    steps: int


class SummaryRound:
    """The open round of one estimator in summary mode (see the module docstring)."""

    def __init__(self, sink: Any, k: int, device: torch.device | str, sketch: bool = True) -> None:
        self.sink = sink
        self.k = k
        self.device = torch.device(device)
        self.keep_sketch = sketch
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        f32 = dict(dtype=torch.float32, device=self.device)
        self.hist = torch.zeros(k * 2 * AUC_SLOTS, **f32)  # (position, label, slot)
        self.ece = torch.zeros(k * ECE_BINS * 2, **f32)  # (position, bin, label)
        self.psum = torch.zeros(k * ECE_BINS, **f32)  # (position, bin)
        self.nll = torch.zeros(k, **f32)
        pos = torch.arange(k, device=self.device)
        self._pos = pos[None, :]
        self._cell0 = (pos * 2 * AUC_SLOTS)[None, :]
        self._bin0 = (pos * ECE_BINS)[None, :]
        #: The pooled coefficients the open round's drafts are scored with (None: local).
        self.version: int | None = None
        self.slope = 0.0
        self.intercepts: tuple[float, ...] = ()
        self.steps = 0
        self.summaries = 0
        self.send_errors = 0
        self.closed_rounds = 0  # handed to the sender
        self.steps_closed = 0  # steps covered by them
        self.handled = 0  # the sender is done with (sent or failed)
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="avest-summaries", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ step
    def sketch(self, est: Any, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
               num_rejected: torch.Tensor) -> None:  # fmt: skip
        """Add one step's drafts to the device sketch (before vLLM's step consumes them)."""
        if not self.keep_sketch:
            return
        idx = idx_mapping.to(torch.int64)
        x = est.features.index_select(0, idx)
        eta = torch.addcmul(est.intercepts[None, :], x, est.slope)
        acc = (num_sampled[: idx.shape[0]].to(torch.int64) - 1).clamp_(min=0)[:, None]
        adm = acc + num_rejected[: idx.shape[0]].to(torch.int64)[:, None]
        obs = ((self._pos <= acc) & (self._pos < adm)).to(torch.float32)
        label = (self._pos < acc).to(torch.int64)
        slot = (eta * _SCALE + _OFFSET).clamp_(0.0, AUC_SLOTS - 1).to(torch.int64)
        self.hist.index_add_(0, (self._cell0 + label * AUC_SLOTS + slot).view(-1), obs.view(-1))
        p = torch.sigmoid(eta)
        b = self._bin0 + (p * ECE_BINS).to(torch.int64).clamp_(max=ECE_BINS - 1)
        self.ece.index_add_(0, (b * 2 + label).view(-1), obs.view(-1))
        self.psum.index_add_(0, b.view(-1), (p * obs).view(-1))
        nll = torch.nn.functional.softplus(eta) - label * eta
        self.nll.add_((nll * obs).sum(0))

    # --------------------------------------------------------------- boundary
    def start(self, version: int, slope: float, intercepts: tuple[float, ...]) -> None:
        """Pooled coefficients now score the drafts: the next round is computed at them."""
        self.version, self.slope, self.intercepts = version, float(slope), tuple(intercepts)

    def stop(self) -> None:
        """Local refits govern again: rounds are not sent until pooled coefficients return."""
        self.version = None

    def end(self, est: Any, zero: bool = True) -> None:
        """Close the open round: queue its sums for the sender, zero them on the device.

        ``zero=False`` (the sidecar was lost) leaves vLLM's sums in place, so
        its local refit goes on from the partial round exactly as vLLM alone
        would; the sketch and the step count start again either way.
        """
        if self.version is not None and self.steps > 0:
            parts = [est.info.reshape(-1), est.grad.reshape(-1), est.counts.reshape(-1)]
            if self.keep_sketch:
                parts += [self.hist, self.ece, self.psum, self.nll]
            buf = torch.cat(parts)
            if self._cuda:
                host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
                host.copy_(buf, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            else:
                host, ready = buf, None
            self.closed_rounds += 1
            self.steps_closed += self.steps
            self._queue.put(
                _Pending(host, ready, self.version, self.slope, self.intercepts, self.steps)
            )
        self.zero(est if zero else None)

    def zero(self, est: Any) -> None:
        """A fresh round: the sketch and step count, and vLLM's sums unless ``est`` is None."""
        if est is not None:
            est.info.zero_()
            est.grad.zero_()
            est.counts.zero_()
        if self.keep_sketch:
            for t in (self.hist, self.ece, self.psum, self.nll):
                t.zero_()
        self.steps = 0

    # ---------------------------------------------------------------- sender
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                summary = self._unpack(item)
                self.sink.submit_summary(summary)
                self.summaries += 1
            except Exception:  # noqa: BLE001 - the sink's problem, never vLLM's
                self.send_errors += 1
                if self.send_errors == 1:
                    logger.exception("avest: sending a round summary failed (further counted)")
            finally:
                self.handled += 1

    def _unpack(self, item: _Pending) -> RoundSummaryData:
        if item.ready is not None:
            item.ready.synchronize()
        v = item.host.numpy().astype(np.float64)
        k = self.k
        info, grad, counts = v[: 3 * k], v[3 * k : 5 * k], v[5 * k : 6 * k]
        sketch = None
        if self.keep_sketch:
            o = 6 * k
            n_hist, n_ece, n_psum = k * 2 * AUC_SLOTS, k * ECE_BINS * 2, k * ECE_BINS
            hist = v[o : o + n_hist]
            ece = v[o + n_hist : o + n_hist + n_ece].reshape(k, ECE_BINS, 2)
            psum = v[o + n_hist + n_ece : o + n_hist + n_ece + n_psum]
            nll = v[o + n_hist + n_ece + n_psum :]
            sketch = Sketch.from_dense(hist, ece[:, :, 0], ece[:, :, 1], psum, nll)
        return RoundSummaryData(
            version=item.version,
            slope=item.slope,
            intercepts=item.intercepts,
            info=info.reshape(k, 3),
            grad=grad.reshape(k, 2),
            counts=np.rint(counts),
            steps=item.steps,
            sketch=sketch,
        )

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every closed round was handed to the sink (tests, shutdown)."""
        import time

        deadline = time.monotonic() + timeout
        while self.handled < self.closed_rounds:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
