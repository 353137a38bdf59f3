"""Summary mode in the worker: one round summary per round, nothing per step on the host.

vLLM's estimator already sums each round's IRLS statistics on the device
(``info`` [K, 3], ``grad`` [K, 2], ``counts`` [K]) at the coefficients its
draft graph used. In summary mode the shim sends those sums once per round,
with the coefficients (and sidecar version) they were computed at, the
number of steps and a calibration sketch, instead of every step's drafts.

Per step (vLLM's thread, only while pooled coefficients govern),
:meth:`SummaryRound.record` makes four device copies into buffers
preallocated for the round (``REFIT_INTERVAL`` x ``max_num_reqs`` x K
float32, plus the per-request counts): vLLM's ``features`` buffer whole and
the step's ``idx_mapping``, ``num_sampled`` and ``num_rejected``, since vLLM's
next ``propose`` overwrites the features. No host copy, no synchronisation,
no arithmetic, no Python loop over requests.

At a round boundary (``REFIT_INTERVAL`` steps, a coefficient update, or the
sidecar lost) :meth:`SummaryRound.end`, on the step, copies vLLM's sums (one
small device op), zeroes them, and hands the round to a sender thread with
its set of kept steps; the next round fills the other set. The sender builds
the round's calibration sketch from the kept steps with fixed-shape torch ops
over ``[T, R, K]`` on the estimator's device (on a side stream after the
round's copies, on CUDA): the linear predictor ``eta = slope x + b_k`` in
float32 with the round's coefficients, as the draft graph computed it; its
AUC slot by label; its ECE bin with the probability; the log loss; all masked
by the observed flag and added with ``index_add_``. It then copies sums and
sketch to the host in one transfer, gives the set back, and hands the sink a
:class:`~avest_client.summary.RoundSummaryData`. Should the sender still hold
both sets when a round starts, that round goes without a sketch (counted in
``sketches_skipped``). The kept steps cost ``2 x REFIT_INTERVAL x
max_num_reqs x K x 4`` bytes of device memory plus the counts (1.6 MiB at 256
requests and K = 8; 52 MiB at 1024 and K = 64); ``AVEST_SKETCH=0`` drops
them and the sketch.

A round only ever holds steps drafted with one set of pooled coefficients:
it starts at the first step whose drafts were scored with coefficients from
the sidecar and ends before different ones apply. Rounds run under vLLM's own
local refits (sidecar absent) are not sent; vLLM refits on them as usual.

Exclusion flags do not apply in summary mode: the sums are vLLM's own, which
include every request.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from avest_client.summary import AUC_SLOTS, ECE_BINS, ETA_RANGE, RoundSummaryData, Sketch

logger = logging.getLogger(__name__)

_SCALE = (AUC_SLOTS - 2) / (2.0 * ETA_RANGE)
_OFFSET = ETA_RANGE * _SCALE + 1.0


@dataclass
class _Kept:
    """One set of round buffers: the steps a round kept for its sketch."""

    features: torch.Tensor  # [round_steps, max_num_reqs, K] float32
    meta: torch.Tensor  # [round_steps, 3, max_num_reqs] int64
    features_np: Any = None  # CPU: numpy views of the same memory
    meta_np: Any = None


@dataclass
class _Pending:
    """A closed round handed to the sender: vLLM's sums and what the sketch needs."""

    sums: torch.Tensor  # info, grad, counts, flattened (on the estimator's device)
    ready: Any  # CUDA event recorded after the round's last copy, or None on CPU
    version: int
    slope: float
    intercepts: tuple[float, ...]
    steps: int
    kept: _Kept | None  # None: no sketch for this round
    rows: list[int]


class SummaryRound:
    """The open round of one estimator in summary mode (see the module docstring)."""

    def __init__(
        self,
        sink: Any,
        k: int,
        device: torch.device | str,
        sketch: bool = True,
        *,
        max_num_reqs: int = 0,
        round_steps: int = 100,
    ) -> None:
        self.sink = sink
        self.k = k
        self.device = torch.device(device)
        self.keep_sketch = sketch and max_num_reqs > 0
        self.round_steps = round_steps
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._cur: _Kept | None = None
        self._free: deque[_Kept] = deque()
        if self.keep_sketch:
            # What vLLM's next propose overwrites, kept for the round: the features
            # buffer and the step's (idx_mapping, num_sampled, num_rejected). Two
            # sets: one fills while the sender builds the last round's sketch.
            for _ in range(2):
                f = torch.zeros(
                    round_steps, max_num_reqs, k, dtype=torch.float32, device=self.device
                )
                m = torch.zeros(round_steps, 3, max_num_reqs, dtype=torch.int64, device=self.device)
                kept = _Kept(f, m)
                if not self._cuda:
                    kept.features_np, kept.meta_np = f.numpy(), m.numpy()
                self._free.append(kept)
            self._cur = self._free.popleft()
            self._row = torch.arange(max_num_reqs, device=self.device)
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        #: Rounds sent without a sketch because the sender still held both buffer sets.
        self.sketches_skipped = 0
        self._src: Any = None
        self._src_np: Any = None
        self._rows: list[int] = []
        self._pos = torch.arange(k, device=self.device)
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
    def record(self, est: Any, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
               num_rejected: torch.Tensor) -> None:  # fmt: skip
        """Keep what the sketch needs of this step (before vLLM's next propose overwrites it).

        Four device copies into the round's preallocated buffers: the features
        buffer whole, and the step's three per-request vectors. Nothing is
        computed per step; :meth:`end` builds the sketch of the whole round.
        """
        t = len(self._rows)
        kept = self._cur
        if kept is None or t >= self.round_steps:
            return
        rows = idx_mapping.shape[0]
        if self._cuda:
            kept.features[t].copy_(est.features, non_blocking=True)
            meta = kept.meta[t]
            meta[0, :rows].copy_(idx_mapping, non_blocking=True)
            meta[1, :rows].copy_(num_sampled[:rows], non_blocking=True)
            meta[2, :rows].copy_(num_rejected[:rows], non_blocking=True)
        else:
            # CPU: the same copies through numpy views (no torch dispatch per copy)
            src = est.features
            if src is not self._src:  # vLLM's buffer is stable: view it once
                self._src, self._src_np = src, src.numpy()
            kept.features_np[t] = self._src_np
            m = kept.meta_np[t]
            m[0, :rows] = idx_mapping.numpy()
            m[1, :rows] = num_sampled.numpy()[:rows]
            m[2, :rows] = num_rejected.numpy()[:rows]
        self._rows.append(rows)

    def _sketch(self, item: _Pending) -> list[torch.Tensor]:
        """A closed round's sketch from its kept steps: fixed-shape ops over [T, R, K]."""
        assert item.kept is not None
        t = len(item.rows)
        k = self.k
        rows = torch.tensor(item.rows, dtype=torch.int64).to(self.device, non_blocking=True)
        valid = self._row[None, :] < rows[:, None]  # [T, R]
        meta = item.kept.meta[:t]
        idx = torch.where(valid, meta[:, 0], 0)
        x = torch.gather(item.kept.features[:t], 1, idx[:, :, None].expand(-1, -1, k))
        coef = torch.tensor((item.slope, *item.intercepts), dtype=torch.float32)
        coef = coef.to(self.device, non_blocking=True)
        eta = torch.addcmul(coef[1:], x, coef[:1])  # as the draft graph computed it, in float32
        acc = (meta[:, 1] - 1).clamp_(min=0)[:, :, None]
        adm = acc + meta[:, 2][:, :, None]
        pos = self._pos
        obs = ((pos <= acc) & (pos < adm) & valid[:, :, None]).to(torch.float32)
        label = (pos < acc).to(torch.int64)
        slot = (eta * _SCALE + _OFFSET).clamp_(0.0, AUC_SLOTS - 1).to(torch.int64)
        cell = (pos * 2 + label) * AUC_SLOTS + slot
        f32 = dict(dtype=torch.float32, device=self.device)
        hist = torch.zeros(k * 2 * AUC_SLOTS, **f32).index_add_(0, cell.view(-1), obs.view(-1))
        p = torch.sigmoid(eta)
        b = pos * ECE_BINS + (p * ECE_BINS).to(torch.int64).clamp_(max=ECE_BINS - 1)
        ece = torch.zeros(k * ECE_BINS * 2, **f32).index_add_(
            0, (b * 2 + label).view(-1), obs.view(-1)
        )
        psum = torch.zeros(k * ECE_BINS, **f32).index_add_(0, b.view(-1), (p * obs).view(-1))
        nll = ((torch.nn.functional.softplus(eta) - label * eta) * obs).sum((0, 1))
        return [hist, ece, psum, nll]

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
            # vLLM's sums are cleared below: copy them (one small device op); the
            # sketch is built by the sender thread from the kept steps.
            sums = torch.cat([est.info.reshape(-1), est.grad.reshape(-1), est.counts.reshape(-1)])
            ready = None
            if self._cuda:
                ready = torch.cuda.Event()
                ready.record()
            kept = self._cur if self._rows else None
            self.closed_rounds += 1
            self.steps_closed += self.steps
            self._queue.put(
                _Pending(sums, ready, self.version, self.slope, self.intercepts, self.steps,
                         kept, list(self._rows))
            )  # fmt: skip
            if kept is not None:
                self._cur = None  # handed to the sender with the round
        if self._cur is None and self.keep_sketch:
            # the next round fills a set the sender gave back; none free: no sketch
            # for that round (counted by the sender as skipped)
            with contextlib.suppress(IndexError):
                self._cur = self._free.popleft()
        self.zero(est if zero else None)

    def zero(self, est: Any) -> None:
        """A fresh round: the sketch and step count, and vLLM's sums unless ``est`` is None."""
        if est is not None:
            est.info.zero_()
            est.grad.zero_()
            est.counts.zero_()
        self._rows.clear()
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
        parts = [item.sums]
        if self._cuda:
            side = self._side
            assert side is not None
            with torch.cuda.device(self.device), torch.cuda.stream(side):
                side.wait_event(item.ready)
                if item.kept is not None:
                    parts += self._sketch(item)
                buf = torch.cat(parts)
                host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
                host.copy_(buf, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            done.synchronize()  # this round's work only; releases the GIL
        else:
            if item.kept is not None:
                parts += self._sketch(item)
            host = torch.cat(parts)
        if item.kept is not None:
            self._free.append(item.kept)  # its steps are read: the step may refill it
        elif self.keep_sketch:
            self.sketches_skipped += 1
        v = host.numpy().astype(np.float64)
        k = self.k
        info, grad, counts = v[: 3 * k], v[3 * k : 5 * k], v[5 * k : 6 * k]
        sketch = None
        if item.kept is not None:
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
