"""Summary mode in the worker: one round summary per round, nothing per step on the host.

vLLM's estimator already sums each round's IRLS statistics on the device
(``info`` [K, 3], ``grad`` [K, 2], ``counts`` [K]) at the coefficients its
draft graph used. In summary mode the shim sends those sums once per round,
with the coefficients (and sidecar version) they were computed at, the
number of steps and a calibration sketch, instead of every step's drafts.

Per step (vLLM's thread, only while pooled coefficients govern),
:meth:`SummaryRound.record` makes one fixed-shape device copy, vLLM's
``features`` buffer whole into the round's slot for the step (preallocated:
``REFIT_INTERVAL`` x ``max_num_reqs`` x K float32), since vLLM's next
``propose`` overwrites it, and keeps references to the step's
``idx_mapping``, ``num_sampled`` and ``num_rejected``. vLLM 0.33 allocates
those three afresh every step (``async_tensor_h2d``, the rejection
sampler's ``new_empty``, ``get_num_sampled_and_rejected``'s ``empty_like``)
and never writes them after the step, so holding them until the round's
sketch is built costs no copy. No host copy, no synchronisation, no
arithmetic, no Python loop over requests.

A caller that reuses its buffers instead (a platform's runner, a test) would
leave the round holding the last values only. The sender checks every
round's references for shared storage (:func:`~avest_client.vllm.sketch.storage_reused`);
on the first such round it sends that round without a sketch and switches to
copying the three vectors too (three more copies per step into a
preallocated ring, counted in ``copy_mode``).

At a round boundary (``REFIT_INTERVAL`` steps, or ``AVEST_ROUND_STEPS``; a
coefficient update; the sidecar lost) :meth:`SummaryRound.end`, on the step, copies vLLM's sums (one
small device op), zeroes them, and hands the round to a sender thread with
its set of kept steps; the next round fills the other set. The sender builds
the round's calibration sketch (:mod:`avest_client.vllm.sketch`) on the
estimator's device (on a side stream after the round's copies, on CUDA),
copies sums and sketch to the host in one transfer, gives the set back (and
drops the round's references), and hands the sink a
:class:`~avest_client.summary.RoundSummary`. Should the sender still hold
both sets when a round starts, that round goes without a sketch (counted in
``sketches_skipped``). The kept steps cost ``2 x round steps x
max_num_reqs x K x 4`` bytes of device memory (1.6 MiB at 256 requests and
K = 8; 52 MiB at 1024 and K = 64) plus the held per-step vectors;
``AVEST_SKETCH=0`` drops them and the sketch.

A round only ever holds steps drafted with one set of pooled coefficients:
it starts at the first step whose drafts were scored with coefficients from
the sidecar and ends before different ones apply. Rounds run under vLLM's own
local refits (sidecar absent) are not sent; vLLM refits on them as usual.

One round in :data:`REACHED_EVERY` (the first, then every tenth) also carries the
features of its drafts that reached each position, verified or trimmed (the summary's
``reached``, for the service's draft-length schedule), binned by the sender with the
sketch.

Exclusion flags do not apply in summary mode: the sums are vLLM's own, which
include every request.

With strata (``AVEST_STRATA=1``, :mod:`avest_client.vllm.strata`) the step does no
more than without them but for one copy of the slots' stratum indices at a step that
follows an admission (``max_num_reqs`` int64 into the round's set, ``round_steps x
max_num_reqs`` per set; the round keeps its steps whatever ``AVEST_SKETCH`` says). The
sender computes, from the round's kept steps, vLLM's IRLS sums per stratum with each
stratum's sketch (:func:`~avest_client.vllm.sketch.build`), every draft scored again at
the set it was predicted with (its stratum's own, or the pair's), and sends one summary
per stratum with drafts; rows of no stratum (slots not seen admitted, strata past the
bound) in one summary without a stratum, as the pair's pooled traffic; excluded
requests' rows in none. A round that starts while the sender still holds both sets is
summed per stratum on the step instead (:meth:`~avest_client.vllm.strata.StrataState.accumulate`,
a few device ops a step until the round ends) and goes without sketches. A round whose
references turned out to be reused buffers cannot be summed per stratum: it goes as
one pooled summary of vLLM's own sums, without a sketch, counted in
``strata_rounds_pooled`` (nothing of it is lost, its strata miss one round).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from avest_client.vllm import sketch as sketches
from avest_client.vllm import strata as strata_mod
from avest_client.vllm.sketch import Held
from avest_wire.errors import InvalidInput
from avest_wire.summary import Reached, RoundSummary, Sketch, make_summary

logger = logging.getLogger(__name__)


@dataclass
class _Kept:
    """One set of round buffers: the steps a round kept for its sketch."""

    features: torch.Tensor  # [round_steps, max_num_reqs, K] float32
    slots: list[Any]  # per step: the features slot (a tensor, or a numpy view on CPU)
    #: per step: the step's tensors (by reference), or its row count (copied into ``ring``)
    held: list[Held | int] = field(default_factory=list)
    ring: torch.Tensor | None = None  # copy mode: [round_steps, 3, max_num_reqs] int64
    ring_np: Any = None  # CPU: a numpy view of ``ring``
    #: strata: each request slot's local stratum index, copied into row t at the round's
    #: first step and at each step t that follows an admission ([round_steps, max_num_reqs])
    strata: torch.Tensor | None = None
    strata_slots: list[Any] = field(default_factory=list)  # per row (a numpy view on CPU)
    strata_copied: list[int] = field(default_factory=list)  # the steps that copied, rising


#: One round in this many carries its reached counts. The schedule reads their
#: distribution, which a sample of rounds gives as well as all of them (one round of
#: 100 steps at a batch of 256 counts 25,600 drafts at the first position, the schedule
#: wants 1,000), while checking them costs the service 26 to 29 us a summary that carries
#: them (+11 % of its parse, check and fold at K = 8; bench/RESULTS.md): a tenth of that
#: on average.
REACHED_EVERY = 10


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
    #: strata: the names by local index and the sets in force (None: without strata)
    strata: tuple[tuple[str, ...], tuple[strata_mod.StratumSet | None, ...]] | None = None
    #: strata, a round summed on the step: its per-stratum sums ([ROWS, K, 6], flattened)
    strata_sums: torch.Tensor | None = None
    #: whether the sender bins its reached counts (one round in REACHED_EVERY)
    reached: bool = False


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
        strata: strata_mod.StrataState | None = None,
    ) -> None:
        self.sink = sink
        #: Strata: per-stratum summaries instead of vLLM's sums (None: without strata).
        self.strata = strata
        self.k = k
        self.device = torch.device(device)
        #: Sketches sent (AVEST_SKETCH), and round steps kept: for the sketch, and with
        #: strata for the per-stratum sums too (whatever AVEST_SKETCH says)
        self.keep_sketch = sketch and max_num_reqs > 0
        self.keep_steps = (sketch or strata is not None) and max_num_reqs > 0
        self.round_steps = round_steps
        self.max_num_reqs = max_num_reqs
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._cur: _Kept | None = None
        self._free: deque[_Kept] = deque()
        #: Set once a round showed reused buffers: the per-step vectors are copied too.
        self.copy_mode = False
        if self.keep_steps:
            # What vLLM's next propose overwrites, kept for the round: the features
            # buffer. Two sets: one fills while the sender builds the last round's sketch.
            for _ in range(2):
                f = torch.zeros(
                    round_steps, max_num_reqs, k, dtype=torch.float32, device=self.device
                )
                slots = list(f.unbind(0)) if self._cuda else list(f.numpy())
                kept = _Kept(f, slots)
                if strata is not None:
                    s = torch.zeros(
                        round_steps, max_num_reqs, dtype=torch.int64, device=self.device
                    )
                    kept.strata = s
                    kept.strata_slots = list(s.unbind(0)) if self._cuda else list(s.numpy())
                self._free.append(kept)
            self._cur = self._free.popleft()
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        #: Rounds sent without a sketch because the sender still held both buffer sets,
        #: or because their references turned out to be reused buffers.
        self.sketches_skipped = 0
        #: Rounds whose reached counts failed their check (sent without them).
        self.reached_skipped = 0
        self._src: Any = None
        self._src_np: Any = None
        #: strata, CPU: a numpy view of the slots' stratum indices (stable, like features)
        self._slot_np: Any = None if strata is None or self._cuda else strata.slot.numpy()
        #: strata: the registry's admissions when the open round last copied the slots
        self._registry = None if strata is None else strata.registry
        self._admissions = -1
        #: strata: rounds sent as one pooled summary of vLLM's sums (see the docstring)
        self.strata_rounds_pooled = 0
        self._t = 0  # steps the open round kept
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
        #: strata: steps the summaries sent counted beyond the rounds' (each counts >= 1)
        self.step_debt = 0
        self.handled = 0  # the sender is done with (sent or failed)
        #: Seconds the sender spent building sketches and reading rounds back (its thread).
        self.sender_seconds = 0.0
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="avest-summaries", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ step
    def record(self, est: Any, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
               num_rejected: torch.Tensor) -> None:  # fmt: skip
        """Keep what the sketch needs of this step (before vLLM's next propose overwrites it).

        One device copy (the features buffer whole into the step's slot) and
        three references; in copy mode three more copies; with strata, a copy
        of the slots' stratum indices after an admission. Nothing is computed
        per step: the sender builds the sketch (and the strata's sums) of the
        whole round. A round whose first step finds no free set of buffers
        keeps none (with strata: sums on the step).
        """
        t = self._t
        kept = self._cur
        if kept is None and self.steps == 0 and self.keep_steps:
            # a round's first step: a set the sender gave back since the last round
            # ended (a round ended while none was free, or before the sidecar was lost)
            with contextlib.suppress(IndexError):
                kept = self._cur = self._free.popleft()
        st = self.strata
        if kept is None:  # no set of buffers for this round (the sender behind, or none)
            if st is not None:  # strata: summed on the step (see the module docstring)
                st.accumulate(est, idx_mapping, num_sampled, num_rejected)
            return
        if t >= self.round_steps:
            return
        src = est.features
        if self._cuda:
            kept.slots[t].copy_(src, non_blocking=True)
        else:
            if src is not self._src:  # vLLM's buffer is stable: view it once
                self._src, self._src_np = src, src.numpy()
            np.copyto(kept.slots[t], self._src_np)  # no torch dispatch on the CPU
        if st is not None:
            # each slot's stratum as this step had it: copied again only after admissions
            seen = self._registry.admissions  # type: ignore[union-attr]
            if t == 0 or seen != self._admissions:
                self._admissions = seen
                if self._cuda:
                    kept.strata_slots[t].copy_(st.slot, non_blocking=True)
                else:
                    np.copyto(kept.strata_slots[t], self._slot_np)
                kept.strata_copied.append(t)
        if self.copy_mode:
            kept.held.append(self._copy(kept, t, idx_mapping, num_sampled, num_rejected))
        else:
            kept.held.append((idx_mapping, num_sampled, num_rejected))
        self._t = t + 1

    def _copy(self, kept: _Kept, t: int, idx_mapping: torch.Tensor, num_sampled: torch.Tensor,
              num_rejected: torch.Tensor) -> int:  # fmt: skip
        """Copy mode: the step's vectors into the set's ring; returns the step's row count."""
        if kept.ring is None:  # allocated on first use: most runs never need it
            kept.ring = torch.zeros(
                self.round_steps, 3, self.max_num_reqs, dtype=torch.int64, device=self.device
            )
            kept.ring_np = None if self._cuda else kept.ring.numpy()
        rows = int(idx_mapping.shape[0])
        if self._cuda:
            m = kept.ring[t]
            m[0, :rows].copy_(idx_mapping, non_blocking=True)
            m[1, :rows].copy_(num_sampled[:rows], non_blocking=True)
            m[2, :rows].copy_(num_rejected[:rows], non_blocking=True)
        else:
            mn = kept.ring_np[t]
            mn[0, :rows] = idx_mapping.numpy()
            mn[1, :rows] = num_sampled.numpy()[:rows]
            mn[2, :rows] = num_rejected.numpy()[:rows]
        return rows

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
            st = self.strata
            sums = torch.cat([est.info.reshape(-1), est.grad.reshape(-1), est.counts.reshape(-1)])
            layout = None if st is None else (tuple(st.registry.names), tuple(st.in_force))
            strata_sums = None
            if st is not None and self._cur is None:  # summed on the step
                strata_sums = st.sums.reshape(-1).clone()
            ready = None
            if self._cuda:  # after every copy the sender reads
                ready = torch.cuda.Event()
                ready.record()
            kept = self._cur if self._t else None
            reached = kept is not None and self.closed_rounds % REACHED_EVERY == 0
            self.closed_rounds += 1
            self.steps_closed += self.steps
            self._queue.put(
                _Pending(
                    sums,
                    ready,
                    self.version,
                    self.slope,
                    self.intercepts,
                    self.steps,
                    kept,
                    layout,
                    strata_sums,
                    reached,
                )  # fmt: skip
            )
            if kept is not None:
                self._cur = None  # handed to the sender with the round
        if self._cur is None and self.keep_steps:
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
        if self.strata is not None:
            self.strata.zero()
        if self._cur is not None:
            self._cur.held.clear()
            self._cur.strata_copied.clear()
        self._t = 0
        self.steps = 0

    # ---------------------------------------------------------------- sender
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                t0 = time.perf_counter()
                if item.strata is None:
                    summary = self._unpack(item)
                    self.sender_seconds += time.perf_counter() - t0
                    self.sink.submit_summary(summary)
                    self.summaries += 1
                else:
                    parts = self._unpack_strata(item)
                    self.sender_seconds += time.perf_counter() - t0
                    for summary, stratum in parts:
                        if stratum is None:
                            self.sink.submit_summary(summary)
                        else:
                            self.sink.submit_summary(summary, stratum)
                        self.summaries += 1
            except Exception:  # noqa: BLE001 - the sink's problem, never vLLM's
                self.send_errors += 1
                if self.send_errors == 1:
                    logger.exception("avest: sending a round summary failed (further counted)")
            finally:
                self.handled += 1

    def _sketch_of(self, item: _Pending, kept: _Kept) -> list[torch.Tensor] | None:
        """The round's sketch (with strata: each group's IRLS sums, then its sketches; the
        groups are each named stratum, the pair's pooled rows, excluded rows), or None
        if its references may be reused buffers.

        Steps kept by reference are trusted only while no round showed shared
        storage; once one did, a round that still holds references (it filled
        while the sender checked the last) goes without a sketch too.
        """
        refs = [h for h in kept.held if not isinstance(h, int)]
        if refs and (self.copy_mode or sketches.storage_reused(refs)):
            if not self.copy_mode:
                logger.warning("avest: the step's tensors are reused buffers; copying them")
            self.copy_mode = True
            return None
        ring = kept.ring
        held: list[Held] = []
        for t, h in enumerate(kept.held):
            if isinstance(h, int):  # copied: views of the ring (the sender's work, not the step's)
                assert ring is not None
                h = (ring[t, 0, :h], ring[t, 1, :h], ring[t, 2, :h])
            held.append(h)
        pair = (item.slope, *item.intercepts)
        if item.strata is None:
            coef = torch.tensor([pair], dtype=torch.float32)
            return sketches.build(kept.features, held, coef, self._pos, reached=item.reached)
        names, in_force = item.strata
        sets = [pair] * (len(names) + 2)
        for i, own in enumerate(in_force[: len(names)]):
            if own is not None:
                sets[i] = (own[1], *own[2])
        coef = torch.tensor(sets, dtype=torch.float32)
        group_of = torch.full((strata_mod.ROWS,), len(names) + 1, dtype=torch.int64)
        group_of[: len(names)] = torch.arange(len(names))
        group_of[strata_mod.POOL] = len(names)
        assert kept.strata is not None
        # step t's slots: the row of the last copy at or before it
        copied = np.asarray(kept.strata_copied, dtype=np.int64)
        last = np.searchsorted(copied, np.arange(len(held)), side="right") - 1
        at = torch.from_numpy(copied[last]).to(kept.strata.device)
        return sketches.build(
            kept.features,
            held,
            coef,
            self._pos,
            slots=kept.strata.index_select(0, at),
            group_of=group_of,
            irls=True,
            sketch=self.keep_sketch,
            reached=item.reached,
        )

    def _read_round(self, item: _Pending) -> tuple[np.ndarray, bool]:
        """The round on the host as float64: vLLM's sums, then what :meth:`_sketch_of`
        built (True) or nothing (False); its kept steps given back for the step to refill."""
        kept = item.kept
        try:
            host, drawn = self._read(item, kept)
        finally:
            if kept is not None:
                if self._side is not None:
                    self._side.synchronize()  # nothing of this round may still read the set
                kept.held.clear()  # drop the round's references: vLLM's allocator may reuse them
                kept.strata_copied.clear()
                self._free.append(kept)  # its steps are read: the step may refill it
        if drawn is None and self.keep_sketch:
            self.sketches_skipped += 1
        return host.numpy().astype(np.float64), drawn is not None

    def _unpack(self, item: _Pending) -> RoundSummary:
        v, drawn = self._read_round(item)
        k = self.k
        sketch = sketches.unpack(v[6 * k :], k)[0] if drawn else None
        reached = sketches.reached_of(v, k)[0] if drawn and item.reached else None
        return self._summary(item, v[: 6 * k], sketch, item.steps, None, reached)

    def _summary(
        self,
        item: _Pending,
        sums: np.ndarray,
        sketch: Sketch | None,
        steps: int,
        own: strata_mod.StratumSet | None,
        reached: np.ndarray | None = None,
    ) -> RoundSummary:
        """One summary of ``sums`` (vLLM's layout: ``a, b, c`` per position, ``g0, g1``,
        ``n``) with ``sketch`` and the ``reached`` counts (dense), at the round's set or a
        stratum's own (``own``)."""
        k = self.k
        slope, intercepts = (item.slope, item.intercepts) if own is None else (own[1], own[2])
        summary = make_summary(
            k,
            version=item.version,
            slope=slope,
            intercepts=intercepts,
            info=sums[: 3 * k],
            grad=sums[3 * k : 5 * k],
            counts=np.rint(sums[5 * k : 6 * k]),
            steps=steps,
            sketch=sketch,
        )
        if reached is None:
            return summary
        try:
            counted = Reached.from_dense(reached, labelled=summary.counts, steps=steps)
        except InvalidInput:  # never the round for an optional part: sent without it
            self.reached_skipped += 1
            return summary
        return dataclasses.replace(summary, reached=counted)

    def _unpack_strata(self, item: _Pending) -> list[tuple[RoundSummary, str | None]]:
        """A round's per-stratum summaries: ``(summary, stratum)``, None for the pair's
        pooled rows (see the module docstring)."""
        assert item.strata is not None
        names, in_force = item.strata
        v, drawn = self._read_round(item)
        k = self.k
        n = len(names)
        # (sums in vLLM's layout, sketch, stratum, its own set, reached counts)
        picked: list[
            tuple[np.ndarray, Sketch | None, str | None, strata_mod.StratumSet | None, Any]
        ]
        groups = n + 2  # the named strata, the pair's pooled rows, excluded rows
        per: np.ndarray | None = None  # [group, position, stat]
        drawn_sketches: list[Sketch | None] = [None] * groups
        reached: np.ndarray | list[None] = [None] * groups
        if item.strata_sums is not None:  # summed on the step, by local index: no sketches
            rows = [*range(n), strata_mod.POOL, strata_mod.EXCLUDED]
            per = v[6 * k :].reshape(strata_mod.ROWS, k, 6)[rows]
        elif drawn:  # summed by the sender, with each group's sketch unless AVEST_SKETCH=0
            per = v[6 * k : 6 * k * (groups + 1)].reshape(6, groups, k).transpose(1, 2, 0)
            if item.reached:
                reached = sketches.reached_of(v, k, groups)
            if self.keep_sketch:
                drawn_sketches = list(sketches.unpack(v[6 * k * (groups + 1) :], k, groups))
        if per is None:  # not summed per stratum: vLLM's sums, as the pair's pooled traffic
            self.strata_rounds_pooled += 1
            picked = [(v[: 6 * k], None, None, None, None)]
        else:
            picked = []
            for g in range(n + 1):
                if per[g, :, 5].sum() > 0 or (g == n and not picked):
                    sums = np.concatenate([per[g, :, 0:3].ravel(), per[g, :, 3:5].ravel(),
                                           per[g, :, 5]])  # fmt: skip
                    own = in_force[g] if g < min(n, len(in_force)) else None
                    picked.append(
                        (sums, drawn_sketches[g], names[g] if g < n else None, own, reached[g])
                    )
        # each summary counts at least one step; a round shorter than its summaries
        # borrows from the next rounds, so the pair's steps still add up
        owed = self.step_debt
        steps = strata_mod.split_steps(max(item.steps - owed, 0), len(picked))
        self.step_debt = max(owed - item.steps, 0) + sum(steps) - max(item.steps - owed, 0)
        return [
            (self._summary(item, sums, sketch, m, own, counted), name)
            for (sums, sketch, name, own, counted), m in zip(picked, steps, strict=True)
        ]

    def _read(self, item: _Pending, kept: _Kept | None) -> tuple[torch.Tensor, Any]:
        """The round's sums and sketch on the host (in one copy), and the sketch's tensors
        (None: no sketch)."""
        parts = [item.sums] + ([] if item.strata_sums is None else [item.strata_sums])
        drawn: list[torch.Tensor] | None = None
        if not self._cuda:
            if kept is not None:
                drawn = self._sketch_of(item, kept)
            return torch.cat(parts + (drawn or [])), drawn
        side = self._side
        assert side is not None
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            side.wait_event(item.ready)
            if kept is not None:
                drawn = self._sketch_of(item, kept)
            buf = torch.cat(parts + (drawn or []))
            host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
            host.copy_(buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()  # this round's work only; releases the GIL
        return host, drawn

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every closed round was handed to the sink (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self.handled < self.closed_rounds:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout: float = 2.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)
