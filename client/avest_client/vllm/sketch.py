"""A round's calibration sketch on the estimator's device, from the steps the round kept.

The shim keeps, per step of a round, vLLM's ``features`` buffer (copied: the
next ``propose`` overwrites it) and the step's ``idx_mapping``,
``num_sampled`` and ``num_rejected`` (the tensors themselves in vLLM 0.33,
which allocates all three afresh every step; copies where a caller reuses its
buffers, see :func:`storage_reused`). :func:`build` turns them into the
round's sketch in the service's bins with one batch of fixed-shape torch ops
over the round's ``N`` request rows: the linear predictor
``eta = slope x + b_k`` in float32 with the round's coefficients (as the draft
graph computed it); its AUC slot by label; its ECE bin with the probability;
the log loss; all masked by the observed flag and added with ``index_add_``.
:func:`unpack` reads the host copy back into a :class:`Sketch`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from avest_client.summary import AUC_SLOTS, ECE_BINS, ETA_RANGE, Sketch

_SCALE = (AUC_SLOTS - 2) / (2.0 * ETA_RANGE)
_OFFSET = ETA_RANGE * _SCALE + 1.0

#: One step as the round kept it: ``(idx_mapping, num_sampled, num_rejected)``.
Held = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def size(k: int) -> int:
    """Floats in a sketch as :func:`build` lays it out (after the round's sums)."""
    return k * 2 * AUC_SLOTS + k * ECE_BINS * 2 + k * ECE_BINS + k


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


def build(
    features: torch.Tensor,
    held: Sequence[Held],
    slope: float,
    intercepts: Sequence[float],
    positions: torch.Tensor,
) -> list[torch.Tensor]:
    """The sketch of a round: ``features`` [T, R, K] kept per step, ``held`` its T steps."""
    device = features.device
    k = int(positions.shape[0])
    rows = [int(h[0].shape[0]) for h in held]
    idx = torch.cat([h[0].reshape(-1) for h in held]).to(device, torch.int64)
    sampled = torch.cat([h[1][:n] for h, n in zip(held, rows, strict=True)])
    rejected = torch.cat([h[2][:n] for h, n in zip(held, rows, strict=True)])
    step = torch.from_numpy(np.repeat(np.arange(len(held), dtype=np.int64), rows))
    step = step.to(device, non_blocking=True)
    x = features[step, idx]  # [N, K]: each row's features as the step graded them
    coef = torch.tensor((slope, *intercepts), dtype=torch.float32).to(device, non_blocking=True)
    eta = torch.addcmul(coef[1:], x, coef[:1])  # as the draft graph computed it, in float32
    acc = (sampled.to(device, torch.int64) - 1).clamp_(min=0)[:, None]
    adm = acc + rejected.to(device, torch.int64)[:, None]
    obs = ((positions <= acc) & (positions < adm)).to(torch.float32)
    label = (positions < acc).to(torch.int64)
    slot = (eta * _SCALE + _OFFSET).clamp_(0.0, AUC_SLOTS - 1).to(torch.int64)
    cell = (positions * 2 + label) * AUC_SLOTS + slot
    f32 = dict(dtype=torch.float32, device=device)
    hist = torch.zeros(k * 2 * AUC_SLOTS, **f32).index_add_(0, cell.view(-1), obs.view(-1))
    p = torch.sigmoid(eta)
    b = positions * ECE_BINS + (p * ECE_BINS).to(torch.int64).clamp_(max=ECE_BINS - 1)
    ece = torch.zeros(k * ECE_BINS * 2, **f32).index_add_(0, (b * 2 + label).view(-1), obs.view(-1))
    psum = torch.zeros(k * ECE_BINS, **f32).index_add_(0, b.view(-1), (p * obs).view(-1))
    nll = ((torch.nn.functional.softplus(eta) - label * eta) * obs).sum(0)
    return [hist, ece, psum, nll]


def unpack(v: npt.NDArray[np.float64], k: int) -> Sketch:
    """The :class:`Sketch` of :func:`build`'s tensors, concatenated and read to the host."""
    n_hist, n_ece, n_psum = k * 2 * AUC_SLOTS, k * ECE_BINS * 2, k * ECE_BINS
    hist = v[:n_hist]
    ece = v[n_hist : n_hist + n_ece].reshape(k, ECE_BINS, 2)
    psum = v[n_hist + n_ece : n_hist + n_ece + n_psum]
    nll = v[n_hist + n_ece + n_psum :]
    return Sketch.from_dense(hist, ece[:, :, 0], ece[:, :, 1], psum, nll)
