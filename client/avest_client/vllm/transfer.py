"""Moving each step's features and verdicts off the device and to the sink, off the step.

On the step (vLLM's thread), :meth:`StepTransfer.capture` does the least that
must happen before the next ``propose`` overwrites ``features``:

* CUDA: on the current (decode) stream, copy the whole ``features`` buffer
  into the ring slot's device snapshot (one fixed-size device copy, no
  gather, no slicing), stack ``(idx_mapping, num_sampled, num_rejected)``
  into one new tensor, and record an event. Nothing waits.
* CPU: the same snapshot as host copies.

then publishes the slot to a bounded queue that drops the oldest when full.

A daemon thread, polling the queue, makes a side stream wait for the event,
copies the snapshot into the slot's pinned host buffers there, waits for that
copy only (never the decode stream), gathers the live rows
(``features[idx_mapping]``), converts vLLM's counts to the wire form
(``num_accepted = max(s - 1, 0)``, ``num_verified = num_accepted +
num_rejected``), releases the slot and calls ``sink.submit``.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from avest_client.vllm.exclusion import ExclusionRegistry
from avest_client.vllm.ringqueue import SlotQueue
from avest_client.vllm.sink import Sink

logger = logging.getLogger(__name__)

#: How often the forwarder thread looks for captured steps when idle. Polling,
#: rather than a notification per step, keeps a futex wake-up off the step.
POLL_S = 0.001


@dataclass
class _Slot:
    features: torch.Tensor  # [max_reqs, K] snapshot on the estimator's device
    host_features: np.ndarray  # host view (pinned buffer on CUDA, the snapshot itself on CPU)
    pinned: torch.Tensor | None = None  # CUDA: the pinned host tensor behind host_features
    meta: Any = None  # CUDA: int64 [3, R] tensor; CPU: (idx, sampled, rejected) arrays
    ready: Any = None  # CUDA: event recorded on the decode stream after the snapshot
    mask: np.ndarray | None = None  # exclusion flags by request-state index, at capture
    strata: Any = None  # strata on: the registry's snapshot at capture (names by slot)


class StepTransfer:
    """A step's drafts off the device and to the sink: ``capture`` on the step, the rest
    on its own thread (see the module docstring)."""

    def __init__(
        self,
        sink: Sink,
        max_num_reqs: int,
        num_positions: int,
        device: torch.device | str,
        queue_size: int,
        exclusion: ExclusionRegistry | None = None,
        name: str = "avest-transfer",
        strata: Any = None,
    ) -> None:
        self.sink = sink
        #: strata on: the process's StrataRegistry (each row's stratum name is sent)
        self.strata = strata
        self.device = torch.device(device)
        self.exclusion = exclusion
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._copied = torch.cuda.Event(blocking=True) if self._cuda else None
        self._max = max_num_reqs
        self._k = num_positions
        self.queue: SlotQueue[_Slot] = SlotQueue(queue_size, self._make_slot)
        self.submitted = 0
        self.submit_errors = 0
        self._src: torch.Tensor | None = None  # CPU: the features tensor last seen ...
        self._src_np: np.ndarray | None = None  # ... and its numpy view (same memory)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _make_slot(self) -> _Slot:
        shape = (self._max, self._k)
        if self._cuda:
            dev = torch.empty(shape, dtype=torch.float32, device=self.device)
            pinned = torch.empty(shape, dtype=torch.float32, pin_memory=True)
            return _Slot(dev, pinned.numpy(), pinned, ready=torch.cuda.Event())
        host = torch.empty(shape, dtype=torch.float32)
        return _Slot(host, host.numpy())

    # ------------------------------------------------------------------ step
    def capture(
        self,
        features: torch.Tensor,
        idx_mapping: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
    ) -> None:
        """Snapshot one step and queue it. Never waits on the device or the consumer."""
        rows = idx_mapping.shape[0]
        if rows > self._max:
            return
        if num_sampled.shape[0] != rows:
            num_sampled, num_rejected = num_sampled[:rows], num_rejected[:rows]
        slot = self.queue.acquire()
        try:
            if self._cuda:
                slot.features.copy_(features)
                slot.meta = torch.stack((idx_mapping, num_sampled, num_rejected))
                slot.ready.record()
            else:
                if features is not self._src:  # vLLM's buffer is stable: view it once
                    self._src, self._src_np = features, features.numpy()
                slot.host_features[...] = self._src_np
                slot.meta = (
                    idx_mapping.numpy().copy(),
                    num_sampled.numpy().copy(),
                    num_rejected.numpy().copy(),
                )
            ex = self.exclusion
            slot.mask = ex.current() if ex is not None and ex.active else None
            st = self.strata
            slot.strata = st.snapshot() if st is not None else None
        except BaseException:
            self.queue.give_back(slot)
            raise
        self.queue.publish(slot)

    # ------------------------------------------------------------ consumer
    def _run(self) -> None:
        q = self.queue
        while True:
            slot = q.get_nowait()
            if slot is None:
                if q.closed:
                    return
                time.sleep(POLL_S)
                continue
            try:
                try:
                    rows = self._unpack(slot)
                except Exception:  # noqa: BLE001
                    logger.exception("avest: reading a captured step failed")
                    rows = None
                finally:
                    slot.meta = None
                    q.recycle(slot)  # read: the producer may refill it
                if rows is None:
                    continue
                try:
                    if rows[4] is None:
                        self.sink.submit(*rows[:4])
                    else:  # strata on: each row's stratum (docs/strata.md)
                        self.sink.submit(*rows)
                    self.submitted += 1
                except Exception:  # noqa: BLE001 - the sink's problem, never vLLM's
                    self.submit_errors += 1
                    if self.submit_errors == 1:
                        logger.exception("avest: sink.submit failed (further failures counted)")
            finally:
                q.done()  # flush() waits for this: the step is with the sink (or failed)

    def _unpack(
        self, slot: _Slot
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, list[str] | None]:
        if self._cuda:
            side, copied = self._side, self._copied
            assert side is not None and copied is not None and slot.pinned is not None
            meta = slot.meta
            host_meta = torch.empty(meta.shape, dtype=meta.dtype, pin_memory=True)
            with torch.cuda.device(self.device), torch.cuda.stream(side):
                side.wait_event(slot.ready)
                slot.pinned.copy_(slot.features, non_blocking=True)
                host_meta.copy_(meta, non_blocking=True)
                meta.record_stream(side)  # allocated on the decode stream, read here
                copied.record(side)
            copied.synchronize()  # this copy only; releases the GIL while waiting
            idx, sampled, rejected = host_meta.numpy()
        else:
            idx, sampled, rejected = slot.meta
        features = slot.host_features[idx]  # fancy indexing: an owned copy of the live rows
        accepted = np.maximum(sampled - 1, 0).astype(np.int32, copy=False)
        verified = (accepted + rejected).astype(np.int32, copy=False)
        exclude = None
        if slot.mask is not None:
            mask = slot.mask
            inside = (idx >= 0) & (idx < mask.shape[0])
            exclude = np.zeros(idx.shape[0], dtype=bool)
            exclude[inside] = mask[idx[inside]]
        names = None
        if slot.strata is not None and self.strata is not None:
            names = self.strata.row_names(slot.strata, idx)
        return features, verified, accepted, exclude, names

    # ------------------------------------------------------------ control
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything captured so far was submitted or dropped (tests, shutdown)."""
        return self.queue.wait_idle(timeout)

    @property
    def dropped(self) -> int:
        return self.queue.dropped

    @property
    def captured(self) -> int:
        return self.queue.published

    def close(self, timeout: float = 2.0) -> None:
        self.queue.close()
        self._thread.join(timeout)
