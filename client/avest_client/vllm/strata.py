"""Strata in the worker: a coefficient set per request slot, round sums per stratum.

Opt-in (``AVEST_STRATA=1``; off, nothing here is built and the shim is exactly
what it was). docs/strata.md has the whole picture; the worker's part:

* **A stratum per request** (:class:`StrataRegistry`), chosen when vLLM admits
  the request (``Sampler.add_request(req_idx, sampling_params)``, the hook the
  exclusion flags already use) from what it declares before drafting: its
  sampling temperature (greedy below vLLM's epsilon) and, optionally, the value
  of one ``extra_args`` key the operator names (``AVEST_STRATA_LABEL``), via
  :func:`avest_wire.strata.stratum_of`. Never from a drafted token. Each name
  gets a local index (first come, at most ``MAX_STRATA``); the slot's index is
  written into the estimator's ``slot`` tensor at once (one small device write
  at admission, ordered before the step's draft graph). A slot never admitted
  through the hook, and a stratum past the bound, carry :data:`POOL`: predicted
  with the pair's set, summed into the pair's pooled summary. A request whose
  target sampling is transformed (:mod:`.exclusion`) carries :data:`EXCLUDED`:
  predicted with the pair's set, in no summary. Raw steps (``AVEST_MODE=raw``,
  ``AVEST_RAW_SAMPLE``) carry each row's stratum name (:meth:`StrataRegistry.row_names`),
  excluded rows included (the exclusion flag travels beside it).
* **Per-slot coefficients** (:meth:`StrataState.apply`, after vLLM's
  ``predict``): fixed-shape torch ops on the device (gather by ``idx_mapping``,
  no host synchronisation), so it runs inside the captured draft graph. Each
  token's slot picks a row of a small ``[S, K+1]`` table; rows whose stratum
  has a served set rewrite the confidence vLLM wrote with that set's logistic,
  the others keep vLLM's value bit for bit (so with no set served, which is
  always so while local refits govern, vLLM's confidences are untouched).
* **Per-stratum round sums**, off the step: the round keeps each step's slot
  indices beside its features (:mod:`.rounds`, a copy only at steps after an
  admission), and the round's sender computes vLLM's IRLS statistics per
  stratum with its sketch (:mod:`.sketch`), each draft scored again at the set
  it was predicted with. A round that finds no free set of round buffers (the
  sender behind) adds them up on the step instead (:meth:`StrataState.accumulate`,
  ``[S, K, 6]`` on the device, one ``index_add_``). The table changes only at
  round boundaries, so every round's drafts of a stratum were scored at one set
  (:attr:`StrataState.in_force`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from avest_client.vllm.calibration import predicted_tokens
from avest_wire.coefficients import slope_ok
from avest_wire.strata import (
    DEFAULT_EDGES,
    LABEL_SEPARATOR,
    MAX_STRATA,
    MAX_STRATUM_BYTES,
    check_stratum,
    stratum_of,
)

logger = logging.getLogger(__name__)

#: Local index of rows predicted and summed as the pair's pooled traffic.
POOL = MAX_STRATA
#: Local index of excluded requests' rows (the pair's set; never summed).
EXCLUDED = MAX_STRATA + 1
#: Rows of the coefficient table and of the round sums.
ROWS = MAX_STRATA + 2

#: One stratum's served set: ``(name, slope, intercepts)``.
StratumSet = tuple[str, float, tuple[float, ...]]


def request_stratum(
    sampling_params: Any, edges: Sequence[float] = DEFAULT_EDGES, label_key: str = ""
) -> str:
    """The stratum of a request from what it declares before drafting.

    Its ``temperature`` (vLLM's ``SamplingParams``; absent: 1.0) and, with
    ``label_key``, ``extra_args[label_key]`` as the label when it is a usable
    one (non-empty, without ``/``, short enough), else no label.
    """
    temperature = getattr(sampling_params, "temperature", 1.0)
    t = 1.0 if temperature is None else float(temperature)
    label: str | None = None
    if label_key:
        extra = getattr(sampling_params, "extra_args", None)
        if isinstance(extra, dict):
            raw = extra.get(label_key)
            if raw is not None:
                text = str(raw)
                if (
                    text
                    and LABEL_SEPARATOR not in text
                    and text.isprintable()
                    and len(text.encode()) <= MAX_STRATUM_BYTES - 12
                ):
                    label = text
    return stratum_of(t, edges, label)


class StrataRegistry:
    """Per-process: each admitted slot's stratum, and each stratum's local index.

    Fed by the sampler hook on vLLM's thread. Indices are given in order of first
    admission, so every TP rank (which admits the same requests in the same order)
    gives the same ones; a set is looked up by name anyway.
    """

    def __init__(self) -> None:
        #: True while strata are on in this process (the sampler hook then records).
        self.enabled = False
        self.active = False  # True once a hook feeds it
        self.edges: tuple[float, ...] = DEFAULT_EDGES
        self.label_key = ""
        self.names: list[str] = []
        self.index: dict[str, int] = {}
        #: Each slot's local index (host copy; grows on demand).
        self.slots = np.full(0, POOL, dtype=np.int64)
        #: Each slot's stratum by name index, excluded requests included (POOL: none),
        #: copy-on-write: a reference stays what it was (raw steps read it later).
        self.named = np.full(0, POOL, dtype=np.int64)
        #: :attr:`names` as a tuple (replaced when a name is added).
        self.names_tuple: tuple[str, ...] = ()
        #: Admissions recorded (a round copies the slots' indices when it moved).
        self.admissions = 0
        #: Admissions past the bound (their stratum is pooled), and errors.
        self.overflow = 0
        self.errors = 0
        self._logged_overflow = False
        self._targets: list[torch.Tensor] = []

    def configure(self, edges: Sequence[float], label_key: str) -> None:
        self.edges = tuple(edges)
        self.label_key = label_key

    def snapshot(self) -> tuple[np.ndarray, tuple[str, ...]] | None:
        """What a raw step needs to name its rows later (references; None: strata off
        or not fed)."""
        if not (self.enabled and self.active):
            return None
        return self.named, self.names_tuple

    @staticmethod
    def row_names(snap: tuple[np.ndarray, tuple[str, ...]], idx: np.ndarray) -> list[str] | None:
        """Each row's stratum name, or None when a row has none (a slot not seen
        admitted, a stratum past the bound): the step then goes without strata."""
        named, names = snap
        if idx.size == 0 or (idx < 0).any() or (idx >= named.shape[0]).any():
            return None
        ind = named[idx]
        if (ind >= len(names)).any():
            return None
        return [names[i] for i in ind.tolist()]

    def attach(self, slot: torch.Tensor) -> None:
        """Write each admission into ``slot`` from now (and what is known already)."""
        n = min(int(slot.shape[0]), self.slots.shape[0])
        if n:
            slot[:n].copy_(torch.from_numpy(self.slots[:n].copy()))
        self._targets.append(slot)

    def detach(self, slot: torch.Tensor) -> None:
        self._targets = [t for t in self._targets if t is not slot]

    def index_of(self, name: str) -> int:
        i = self.index.get(name)
        if i is not None:
            return i
        if len(self.names) >= MAX_STRATA:
            self.overflow += 1
            if not self._logged_overflow:
                self._logged_overflow = True
                logger.warning(
                    "avest: %d strata in this worker already; stratum %s (and any further "
                    "one) is predicted and summed as the pair's pooled traffic",
                    MAX_STRATA,
                    name,
                )
            return POOL
        i = len(self.names)
        self.names.append(name)
        self.names_tuple = tuple(self.names)
        self.index[name] = i
        return i

    def record(self, req_idx: int, sampling_params: Any, excluded: bool = False) -> None:
        """A request was admitted into slot ``req_idx``."""
        try:
            named = self.index_of(request_stratum(sampling_params, self.edges, self.label_key))
        except Exception:  # noqa: BLE001 - a request we cannot place is pooled traffic
            self.errors += 1
            named = POOL
        i = EXCLUDED if excluded else named
        self.admissions += 1
        if req_idx >= self.slots.shape[0]:
            grown = np.full(max(req_idx + 1, 2 * self.slots.shape[0], 256), POOL, dtype=np.int64)
            grown[: self.slots.shape[0]] = self.slots
            self.slots = grown
        self.slots[req_idx] = i
        if req_idx >= self.named.shape[0] or self.named[req_idx] != named:
            new = np.full(max(req_idx + 1, self.named.shape[0], 256), POOL, dtype=np.int64)
            new[: self.named.shape[0]] = self.named
            new[req_idx] = named
            new.flags.writeable = False
            self.named = new
        for t in self._targets:
            if req_idx < t.shape[0]:
                t[req_idx] = i  # a fill on the current stream: no host synchronisation


REGISTRY = StrataRegistry()


def validate_sets(raw: object, k: int) -> tuple[StratumSet, ...]:
    """A sink's ``latest_strata()`` (name -> Served, or name -> (slope, intercepts)) as
    checked sets in name order; unusable entries are left out (the pair's set serves)."""
    if not raw or not isinstance(raw, dict):
        return ()
    out: list[StratumSet] = []
    for name, value in raw.items():
        try:
            check_stratum(name)
            if hasattr(value, "slope"):
                slope, b = float(value.slope), tuple(float(x) for x in value.intercepts)
            else:
                s, bs = value
                slope, b = float(s), tuple(float(x) for x in bs)
        except Exception:  # noqa: BLE001
            continue
        if len(b) == k and slope_ok(slope) and all(math.isfinite(x) for x in b):
            out.append((name, slope, b))
    return tuple(sorted(out))


class StrataState:
    """One estimator's strata on its device (see the module docstring)."""

    def __init__(
        self, max_num_reqs: int, k: int, device: Any, registry: StrataRegistry | None = None
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self.k = k
        self.max_num_reqs = max_num_reqs
        dev = torch.device(device)
        self.device = dev
        self.slot = torch.full((max_num_reqs,), POOL, dtype=torch.int64, device=dev)
        #: Coefficient sets by local index: ``(slope, b_0 .. b_{K-1})``.
        self.table = torch.zeros(ROWS, k + 1, dtype=torch.float32, device=dev)
        #: 1.0 where the index's own set is served, else 0.0 (the pair's set).
        self.served = torch.zeros(ROWS, dtype=torch.float32, device=dev)
        #: A round summed on the step: per index and position a_k, b_k, c_k, g0_k, g1_k, n_k.
        self.sums = torch.zeros(ROWS, k, 6, dtype=torch.float32, device=dev)
        self._pos = torch.arange(k, device=dev)
        #: The sets the table serves now, by local index (None: the pair's).
        self.in_force: list[StratumSet | None] = [None] * MAX_STRATA
        self._sets: tuple[StratumSet, ...] = ()
        self._governed = False
        self._names_loaded = -1
        self.loads = 0
        self.registry.attach(self.slot)

    # ------------------------------------------------------------ the table
    def pending(self, sets: tuple[StratumSet, ...], governed: bool) -> bool:
        """Whether loading ``sets`` now would change what the table serves.

        Decided from what every TP rank shares (the broadcast sets, the governor's
        decision, the strata admitted), so every rank loads at the same step."""
        if sets != self._sets or governed != self._governed:
            return True
        names = self.registry.names
        n = len(names)
        if n == self._names_loaded:
            return False
        if governed and any(s[0] in names[self._names_loaded : n] for s in sets):
            return True  # a newly admitted stratum has a pushed set
        self._names_loaded = n
        return False

    def load(self, sets: tuple[StratumSet, ...], governed: bool) -> None:
        """Serve ``sets`` (only while pooled coefficients govern) for the strata this
        worker has named; every other index predicts with the pair's set."""
        names = list(self.registry.names)
        by_name = {s[0]: s for s in sets} if governed else {}
        values = np.zeros((ROWS, self.k + 2), dtype=np.float32)
        in_force: list[StratumSet | None] = [None] * MAX_STRATA
        for i, name in enumerate(names):
            own = by_name.get(name)
            if own is None:
                continue
            in_force[i] = own
            values[i, 0] = own[1]
            values[i, 1 : self.k + 1] = own[2]
            values[i, -1] = 1.0
        host = torch.from_numpy(values)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.table.copy_(host[:, : self.k + 1], non_blocking=True)
        self.served.copy_(host[:, -1], non_blocking=True)
        self.in_force = in_force
        self._sets = sets
        self._governed = governed
        self._names_loaded = len(names)
        self.loads += 1

    # ------------------------------------------------------------ predict
    def apply(
        self,
        est: Any,
        num_tokens: int,
        idx_mapping: torch.Tensor,
        draft_step: torch.Tensor,
        confidence_probs: torch.Tensor,
    ) -> None:
        """After vLLM's ``predict`` (and the pair's calibration map): the confidences
        of tokens whose slot's stratum has a served set, at that set. Fixed shapes, no
        host sync."""
        req, valid, step, batch = predicted_tokens(num_tokens, idx_mapping, draft_step, self.k)
        safe = req.clamp(min=0)
        s = self.slot[safe]
        coef = self.table[s]  # [n, K+1]
        x = est.features[safe, step]
        # (addcmul: as the round's sender scores the draft again, bit for bit)
        eta = torch.addcmul(coef.gather(1, (step + 1)[:, None])[:, 0], x, coef[:, 0])
        own = torch.sigmoid(eta)
        use = valid & (self.served[s] > 0.5)
        current = confidence_probs[batch, step]
        confidence_probs[batch, step] = torch.where(use, own.to(confidence_probs.dtype), current)

    # --------------------------------------------------------------- step
    def accumulate(
        self,
        est: Any,
        idx_mapping: torch.Tensor,
        num_sampled: torch.Tensor,
        num_rejected: torch.Tensor,
    ) -> None:
        """Add this step's verified drafts to their strata's round sums (vLLM's IRLS
        statistics at the prediction each draft was scored with: its stratum's served
        set, else vLLM's own; the table is the one the step's drafts were predicted
        with). Only for a round without kept steps (see the module docstring)."""
        idx = idx_mapping.to(torch.int64)
        r = int(idx.shape[0])
        if r == 0:
            return
        accepted = (num_sampled[:r].to(torch.int64) - 1).clamp_(min=0)[:, None]
        admitted = accepted + num_rejected[:r].to(torch.int64)[:, None]
        pos = self._pos[None, :]
        obs = ((pos <= accepted) & (pos < admitted)).to(torch.float32)
        label = (pos < accepted).to(torch.float32)
        s = self.slot[idx]
        x = est.features[idx]
        coef = self.table[s]  # as apply() computed each draft's own prediction
        own = torch.sigmoid(torch.addcmul(coef[:, 1:], x, coef[:, :1]))
        p = torch.where(self.served[s][:, None] > 0.5, own, est.predictions[idx])
        w = p * (1.0 - p) * obs
        res = (label - p) * obs
        wx = w * x
        stats = torch.stack((wx * x, wx, w, res * x, res, obs), dim=-1)  # [R, K, 6]
        self.sums.index_add_(0, s, stats)

    def zero(self) -> None:
        self.sums.zero_()

    def stats(self) -> dict[str, Any]:
        reg = self.registry
        return {
            "names": list(reg.names),
            "served": [s[0] for s in self.in_force if s is not None],
            "loads": self.loads,
            "overflow": reg.overflow,
            "active": reg.active,
        }

    def close(self) -> None:
        self.registry.detach(self.slot)


def split_steps(steps: int, parts: int) -> list[int]:
    """``steps`` shared among ``parts`` summaries (each at least 1), adding up to
    ``steps`` whenever ``steps >= parts``."""
    if parts <= 0:
        return []
    base, extra = divmod(steps, parts)
    return [max(1, base + (1 if i < extra else 0)) for i in range(parts)]


class StrataSync:
    """Which strata sets are pushed, decided at step boundaries identically on every
    TP rank (as :class:`~avest_client.vllm.calibration.TableSync` decides the table):
    rank 0 reads the sink's ``latest_strata()``, every ``sync_steps`` steps with
    tensor parallelism, and broadcasts it."""

    def __init__(self, group: Any, sink: Any, sync_steps: int, k: int) -> None:
        self.group = group
        self.sink = sink if group.rank == 0 else None
        self.sync_steps = sync_steps
        self.k = k
        self.steps = 0
        self.sets: tuple[StratumSet, ...] = ()
        self._errors = 0
        self._last_raw: object = None
        self._single = group.world_size == 1
        #: the sink's reader, looked up once (None: the sink serves no strata)
        self._reader = getattr(self.sink, "latest_strata", None)

    def _read_sink(self) -> tuple[StratumSet, ...]:
        reader = self._reader
        if reader is None:
            return ()
        try:
            raw = reader()
            if raw is not self._last_raw:  # unchanged: already validated
                self._last_raw = raw
                return validate_sets(raw, self.k)
            return self.sets
        except Exception:  # noqa: BLE001 - a faulty sink must not stop decoding
            self._errors += 1
            if self._errors == 1:
                logger.exception("avest: reading the strata failed; the pair's set serves")
            return ()

    def boundary(self) -> tuple[StratumSet, ...]:
        """Call at every step boundary on every rank: the sets pushed now."""
        n = self.steps
        self.steps = n + 1
        if self._single:
            self.sets = self._read_sink()
        elif n % self.sync_steps == 0:
            mine = self._read_sink() if self.group.rank == 0 else None
            self.sets = tuple(self.group.broadcast_object(mine) or ())
        return self.sets
