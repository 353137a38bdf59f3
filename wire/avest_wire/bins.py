"""The bins of the wire contract: where a draft lands in a calibration sketch.

A worker's round summary carries its calibration as sums in fixed bins, so
that sums from many workers add up (``protos/avest/v1/estimator.proto``,
``CalibrationSketch``). Sender and service must bin alike, so the bins are
defined here once and read by the client's numpy builder, the shim's torch
builder and the service's core.

- **AUC slots**: the linear predictor ``eta = slope x + b_k`` in
  :data:`AUC_BINS` equal bins on ``[-ETA_RANGE, ETA_RANGE)``, plus an
  underflow slot (0) and an overflow slot (``AUC_SLOTS - 1``). 1024 bins of
  width 0.023 in ``eta`` move an AUC by well under 1e-3 against the exact
  rank statistic; ``|eta| = 12`` is a probability within 6e-6 of 0 or 1, where
  the ranking of two drafts no longer matters for trimming.
- **ECE bins**: :data:`ECE_BINS` equal-width bins of the probability, the
  usual reliability-diagram resolution (15, as in Guo et al. 2017).
- **Sketch cells**: ``(position * 2 + label) * AUC_SLOTS + slot``, label 1
  for an accepted draft; :data:`CELLS_PER_POSITION` per position.
- **Feature bins**: the feature ``x = logit(q_max)`` in :data:`FEATURE_BINS`
  equal bins on ``[-MAX_LOG_ODDS, MAX_LOG_ODDS]``; a round summary's counts of
  the drafts that reached each position (``RoundSummary.reached``), cells
  ``position * FEATURE_BINS + bin``.
- **Calibration-layer knots**: the served monotone map is a table of
  :data:`CALIBRATION_SLOTS` knots over ``eta`` (bin centres of
  :data:`CALIBRATION_BINS` bins on ``[-CALIBRATION_ETA_MAX,
  CALIBRATION_ETA_MAX)`` plus one knot beyond each end); the service
  computes it and the shim applies it, so both sides agree on its size.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from avest_wire.limits import MAX_LOG_ODDS

#: Equal-width bins of the linear predictor for the AUC histograms.
AUC_BINS = 1024
#: The AUC bins cover ``eta`` in ``[-ETA_RANGE, ETA_RANGE)``.
ETA_RANGE = 12.0
#: AUC slots per class and position: underflow, ``AUC_BINS`` bins, overflow.
AUC_SLOTS = AUC_BINS + 2
#: Equal-width probability bins for ECE and the reliability diagram.
ECE_BINS = 15
#: Cells of a sketch's linear-predictor histogram per position: (label, slot).
CELLS_PER_POSITION = 2 * AUC_SLOTS

#: ``slot = clip(eta * ETA_SCALE + ETA_OFFSET, 0, AUC_SLOTS - 1)``, truncated: the
#: same affine map in numpy (float64) and torch (float32) on every side.
ETA_SCALE = AUC_BINS / (2.0 * ETA_RANGE)
ETA_OFFSET = ETA_RANGE * ETA_SCALE + 1.0

#: Equal bins of ``x`` on ``[-MAX_LOG_ODDS, MAX_LOG_ODDS]`` (0.25 wide): the mean of
#: ``sigmoid(w x + b)`` over a bin moves by under 3e-4 against its value at the centre
#: for ``w <= 1``; the vLLM clamp at +40 falls in the last bin.
FEATURE_BINS = 320
#: ``bin = min(trunc((clip(x, -40, 40) + FEATURE_OFFSET) * FEATURE_SCALE), FEATURE_BINS - 1)``:
#: the same map in numpy (float64) and torch (float32) on every side.
FEATURE_SCALE = FEATURE_BINS / (2.0 * MAX_LOG_ODDS)
FEATURE_OFFSET = MAX_LOG_ODDS

#: Inner bins of the calibration layer's table on ``[-CALIBRATION_ETA_MAX, ...)``:
#: 32 bins of 0.5 in ``eta`` are fine enough for a monotone map and few enough that
#: each holds thousands of drafts after a round.
CALIBRATION_BINS = 32
#: ``|eta| = 8`` is a probability within 3.4e-4 of 0 or 1; beyond it the map is flat.
CALIBRATION_ETA_MAX = 8.0
#: Table knots: underflow, ``CALIBRATION_BINS`` centres, overflow.
CALIBRATION_SLOTS = CALIBRATION_BINS + 2

IntArray = npt.NDArray[np.intp]


def eta_slot(eta: npt.ArrayLike) -> IntArray:
    """AUC slot of each ``eta``: 0 below -12, 1..1024 inside, 1025 at or above 12."""
    v = np.clip(np.asarray(eta, dtype=np.float64) * ETA_SCALE + ETA_OFFSET, 0.0, AUC_SLOTS - 1)
    return v.astype(np.intp)


def probability_bin(p: npt.ArrayLike) -> IntArray:
    """ECE bin of each probability in [0, 1]; 1.0 falls in the last bin."""
    b = (np.asarray(p, dtype=np.float64) * ECE_BINS).astype(np.intp)
    return np.minimum(b, ECE_BINS - 1)


def feature_bin(x: npt.ArrayLike) -> IntArray:
    """Feature bin of each ``x``: ``[-40, -39.75)`` is bin 0, 40 (the clamp) is the last."""
    v = np.clip(np.asarray(x, dtype=np.float64), -MAX_LOG_ODDS, MAX_LOG_ODDS)
    return np.minimum(((v + FEATURE_OFFSET) * FEATURE_SCALE).astype(np.intp), FEATURE_BINS - 1)


def sketch_size(k: int) -> int:
    """Numbers in a dense sketch of ``k`` positions: histogram, ECE counts, ECE sums, log loss."""
    return k * CELLS_PER_POSITION + k * ECE_BINS * 2 + k * ECE_BINS + k
