"""A round's calibration sketch on the estimator's device, from the steps the round kept.

The shim keeps, per step of a round, vLLM's ``features`` buffer (copied: the
next ``propose`` overwrites it) and the step's ``idx_mapping``,
``num_sampled`` and ``num_rejected`` (the tensors themselves in vLLM 0.33,
which allocates all three afresh every step; copies where a caller reuses its
buffers, see :func:`storage_reused`). :func:`build` turns them into the
round's sketch in the service's bins with fixed-shape torch ops over the
round's ``N`` request rows (in one batch on CUDA; on the CPU in chunks of
steps small enough that each op runs on one thread): the linear predictor
``eta = slope x + b_k`` in float32 with the round's coefficients (as the draft
graph computed it); its AUC slot by label; its ECE bin with the probability;
the log loss; all masked by the observed flag and added with ``index_add_``;
and, last, the feature bin of every draft that reached its position (verified or
trimmed: the round summary's ``reached``). :func:`unpack` reads the host copy
back into a :class:`Sketch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from avest_wire.bins import (
    AUC_SLOTS,
    ECE_BINS,
    ETA_OFFSET,
    ETA_SCALE,
    FEATURE_BINS,
    FEATURE_OFFSET,
    FEATURE_SCALE,
    sketch_size,
)
from avest_wire.limits import MAX_LOG_ODDS
from avest_wire.summary import Sketch

#: One step as the round kept it: ``(idx_mapping, num_sampled, num_rejected)``.
Held = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def size(k: int) -> int:
    """Floats in a sketch as :func:`build` lays it out (after the round's sums)."""
    return sketch_size(k)


def storage_reused(held: Sequence[Held]) -> bool:
    """Whether two steps of a round handed over the same storage for one role.

    The round holds every step's tensors until its sketch is built, so a
    caller that allocates them afresh (vLLM) can never hand over memory the
    round still holds: equal storage means a reused buffer, whose earlier
    steps were overwritten, and the round's references are not its steps.
    """
    for role in range(3):
        seen: set[int] = set()
        for step in held:
            t = step[role]
            if t.numel() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                return True
            seen.add(ptr)
    return False


#: CPU: at most this many elements per op, so torch runs each op on one thread (its
#: intra-op grain is 32768): the sketch then never spins every core beside vLLM's thread.
CPU_CHUNK = 16384


def build(
    features: torch.Tensor,
    held: Sequence[Held],
    coef: torch.Tensor,
    positions: torch.Tensor,
    *,
    slots: torch.Tensor | None = None,
    group_of: torch.Tensor | None = None,
    irls: bool = False,
    sketch: bool = True,
    reached: bool = False,
) -> list[torch.Tensor]:
    """The sketch of a round: ``features`` [T, R, K] kept per step, ``held`` its T steps.

    ``coef`` [G, K+1] holds G coefficient sets ``(slope, b_0 .. b_{K-1})``, one per
    group of rows, and the result G sketches, group after group (:func:`unpack`). One
    set (G = 1) scores every row. With strata, ``slots`` [T, R] holds each step's
    local stratum index per request slot, as the step's sums used it, and ``group_of``
    maps such an index to its group: each row is scored with its group's set and
    counted in its group's sketch. ``irls``: first, each group's vLLM IRLS sums per
    position (``[6, G, K]``: ``a, b, c, g0, g1, n``, at the probability each row is
    scored with), as vLLM's step adds them up; ``sketch=False``: those sums alone.
    ``reached``: last, each group's drafts that reached their position by feature bin
    (``[G, K * FEATURE_BINS]``): every draft of a request past its prefill whose
    earlier drafts were all accepted, verified or not.
    """
    device = features.device
    k = int(positions.shape[0])
    g = int(coef.shape[0])
    f32 = dict(dtype=torch.float32, device=device)
    assert irls or sketch
    acc = [torch.zeros(g * k * 6, **f32)] if irls else []
    if sketch:
        acc += [
            torch.zeros(g * k * 2 * AUC_SLOTS, **f32),
            torch.zeros(g * k * ECE_BINS * 2, **f32),
            torch.zeros(g * k * ECE_BINS, **f32),
            torch.zeros(g * k, **f32),
        ]
    if reached:
        acc.append(torch.zeros(g * k * FEATURE_BINS, **f32))
    coef = coef.to(device, torch.float32, non_blocking=True)
    groups = None
    if slots is not None:
        assert group_of is not None
        groups = (slots, group_of.to(device, non_blocking=True))
    rows = [int(h[0].shape[0]) for h in held]
    if device.type == "cuda":
        _add(acc, features, held, rows, 0, coef, positions, groups, irls, sketch, reached)
        return acc
    start = 0
    while start < len(held):  # CPU: chunks of steps, each op under torch's intra-op grain
        n, stop = 0, start
        while stop < len(held) and (stop == start or (n + rows[stop]) * k <= CPU_CHUNK):
            n += rows[stop]
            stop += 1
        part = held[start:stop]
        _add(acc, features, part, rows[start:stop], start, coef, positions, groups, irls, sketch,
             reached)  # fmt: skip
        start = stop
    return acc


def _add(
    acc: list[torch.Tensor],
    features: torch.Tensor,
    held: Sequence[Held],
    rows: list[int],
    first: int,
    coef: torch.Tensor,
    positions: torch.Tensor,
    groups: tuple[torch.Tensor, torch.Tensor] | None,
    irls: bool,
    sketch: bool,
    reached: bool,
) -> None:
    """Add steps ``first ..`` (``held``, with ``rows`` requests each) to ``acc``, as
    :func:`build` laid it out."""
    device = features.device
    idx = torch.cat([h[0].reshape(-1) for h in held]).to(device, torch.int64)
    sampled = torch.cat([h[1][:n] for h, n in zip(held, rows, strict=True)])
    rejected = torch.cat([h[2][:n] for h, n in zip(held, rows, strict=True)])
    t, r, k = features.shape
    base = np.repeat(np.arange(first, first + len(held), dtype=np.int64) * r, rows)
    flat = torch.from_numpy(base).to(device, non_blocking=True) + idx
    x = features.view(t * r, k).index_select(0, flat)  # [N, K]: as the step graded them
    if groups is None:
        eta = torch.addcmul(coef[0, 1:], x, coef[0, :1])  # as the draft graph computed it
        cell_pos = positions  # the sketch's (position) rows
        group = None
    else:
        slots, group_of = groups
        group = group_of[slots.reshape(-1).index_select(0, flat)]  # [N]: slots [>= T, R]
        c = coef.index_select(0, group)  # [N, K+1]: each row's set
        eta = torch.addcmul(c[:, 1:], x, c[:, :1])  # as the strata's predict computed it
        cell_pos = group[:, None] * k + positions  # the sketch's (group, position) rows
    accepted = (sampled.to(device, torch.int64) - 1).clamp_(min=0)[:, None]
    admitted = accepted + rejected.to(device, torch.int64)[:, None]
    obs = ((positions <= accepted) & (positions < admitted)).to(torch.float32)
    label = (positions < accepted).to(torch.int64)
    p = torch.sigmoid(eta)
    if irls:  # vLLM's IRLS statistics, as its step accumulates them
        w = p * (1.0 - p) * obs
        res = (label - p) * obs
        wx = w * x
        sums = acc[0].view(6, -1, k)  # a stat at a time: [N, K] ops, one thread each on the CPU
        for j, stat in enumerate((wx * x, wx, w, res * x, res, obs)):
            if group is None:
                sums[j, 0].add_(stat.sum(0))
            else:
                sums[j].index_add_(0, group, stat)
    if reached:
        # every draft of a request past its prefill whose earlier drafts were accepted
        got = ((positions <= accepted) & (sampled.to(device) >= 1)[:, None]).to(torch.float32)
        fbin = (x.clamp(-MAX_LOG_ODDS, MAX_LOG_ODDS) + FEATURE_OFFSET) * FEATURE_SCALE
        fbin = fbin.to(torch.int64).clamp_(max=FEATURE_BINS - 1)
        acc[-1].index_add_(0, (cell_pos * FEATURE_BINS + fbin).view(-1), got.view(-1))
    if not sketch:
        return
    first = len(acc) - (5 if reached else 4)
    hist, ece, psum, nll = acc[first : first + 4]
    slot = (eta * ETA_SCALE + ETA_OFFSET).clamp_(0.0, AUC_SLOTS - 1).to(torch.int64)
    hist.index_add_(0, ((cell_pos * 2 + label) * AUC_SLOTS + slot).view(-1), obs.view(-1))
    b = cell_pos * ECE_BINS + (p * ECE_BINS).to(torch.int64).clamp_(max=ECE_BINS - 1)
    ece.index_add_(0, (b * 2 + label).view(-1), obs.view(-1))
    psum.index_add_(0, b.view(-1), (p * obs).view(-1))
    loss = (torch.nn.functional.softplus(eta) - label * eta) * obs
    if group is None:
        nll.add_(loss.sum(0))
    else:
        nll.view(-1, k).index_add_(0, group, loss)


def unpack(v: npt.NDArray[np.float64], k: int, groups: int = 1) -> list[Sketch]:
    """The :class:`Sketch` of each group of :func:`build`'s tensors, concatenated and read
    to the host."""
    n_hist, n_ece, n_psum = k * 2 * AUC_SLOTS, k * ECE_BINS * 2, k * ECE_BINS
    g = groups
    hist = v[: g * n_hist].reshape(g, n_hist)
    at = g * n_hist
    ece = v[at : at + g * n_ece].reshape(g, k, ECE_BINS, 2)
    at += g * n_ece
    psum = v[at : at + g * n_psum].reshape(g, n_psum)
    at += g * n_psum
    nll = v[at : at + g * k].reshape(g, k)
    return [
        Sketch.from_dense(hist[i], ece[i, :, :, 0], ece[i, :, :, 1], psum[i], nll[i])
        for i in range(g)
    ]


def reached_of(v: npt.NDArray[np.float64], k: int, groups: int = 1) -> npt.NDArray[np.float64]:
    """Each group's reached counts ``[G, K * FEATURE_BINS]``: the tail of :func:`build`'s
    tensors (built with ``reached``), concatenated and read to the host."""
    n = groups * k * FEATURE_BINS
    return v[v.size - n :].reshape(groups, k * FEATURE_BINS)
