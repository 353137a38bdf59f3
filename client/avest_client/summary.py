"""Summary mode, client side: a worker's round built on the host from raw steps.

A :class:`~avest_wire.summary.RoundSummary` is what a forwarder queues with
:meth:`~avest_client.forwarder.Forwarder.submit_summary`: the IRLS sums of one
round (``info`` [K, 3], ``grad`` [K, 2], ``counts`` [K], as vLLM's estimator
keeps them), the coefficients (and their version) the round's predictions
were made with, the steps and labelled drafts it covers, and optionally a
calibration sketch in the contract's bins (:mod:`avest_wire.bins`) and the
features of the drafts that reached each position (``reached``). It takes
the next sequence number like a step, so summaries and raw steps share one
ledger: acknowledgements, resends after a reconnect and drops work the same.

:class:`RoundAccumulator` builds summaries on the host from raw steps
(numpy, float64): the reference for the shim's on-device accumulator and the
way ``avest replay --summary`` sends a trace in summary mode.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from avest_wire.bins import (
    AUC_SLOTS,
    ECE_BINS,
    FEATURE_BINS,
    eta_slot,
    feature_bin,
    probability_bin,
)
from avest_wire.summary import Reached, RoundSummary, Sketch, make_summary


class RoundAccumulator:
    """A worker's open round on the host: fold raw steps, take a summary (numpy, float64)."""

    def __init__(self, k: int, sketch: bool = True, reached: bool = False) -> None:
        """``reached``: the summaries also count the features of the drafts that reached
        each position (the vLLM plugin sends them with one round in ten)."""
        self.k = k
        self.sketch = sketch
        self.keep_reached = reached
        self.clear()

    def clear(self) -> None:
        k = self.k
        self.info = np.zeros((k, 3))
        self.grad = np.zeros((k, 2))
        self.counts = np.zeros(k)
        self.hist = np.zeros(k * 2 * AUC_SLOTS)
        self.ece = np.zeros((k, ECE_BINS, 2))
        self.psum = np.zeros((k, ECE_BINS))
        self.nll = np.zeros(k)
        self.reached = np.zeros(k * FEATURE_BINS if self.keep_reached else 0)
        self.steps = 0

    def add(
        self,
        features: npt.ArrayLike,
        num_verified: npt.ArrayLike,
        num_accepted: npt.ArrayLike,
        slope: float,
        intercepts: npt.ArrayLike,
        exclude: npt.ArrayLike | None = None,
    ) -> None:
        """Fold one step scored at ``(slope, intercepts)``."""
        x = np.asarray(features, dtype=np.float64)
        k = self.k
        pos = np.arange(k)[None, :]
        a = np.asarray(num_accepted, dtype=np.int64)[:, None]
        d = np.asarray(num_verified, dtype=np.int64)[:, None]
        obs = (pos <= a) & (pos < d)
        if exclude is not None:
            obs &= ~np.asarray(exclude, dtype=bool)[:, None]
        y = (pos < a) & obs
        eta = slope * x + np.asarray(intercepts, dtype=np.float64)[None, :]
        t = np.exp(-np.abs(eta))
        p = np.where(eta >= 0.0, 1.0, t) / (1.0 + t)
        m = obs.astype(np.float64)
        w = p * (1.0 - p) * m
        r = (y - p) * m
        xo = np.where(obs, x, 0.0)
        self.info[:, 0] += (w * xo * xo).sum(0)
        self.info[:, 1] += (w * xo).sum(0)
        self.info[:, 2] += w.sum(0)
        self.grad[:, 0] += (r * xo).sum(0)
        self.grad[:, 1] += r.sum(0)
        self.counts += m.sum(0)
        self.steps += 1
        if self.keep_reached:
            # position i reached: drafts 0 .. i-1 accepted; a request with nothing
            # verified is left out (trimmed whole, or no drafts: a raw step cannot tell)
            got = (pos <= a) & (d >= 1)
            if exclude is not None:
                got &= ~np.asarray(exclude, dtype=bool)[:, None]
            rows, cols = np.nonzero(got)
            np.add.at(self.reached, cols * FEATURE_BINS + feature_bin(x[rows, cols]), 1.0)
        if not self.sketch or not obs.any():
            return
        rows, cols = np.nonzero(obs)
        e, yy, pp = eta[rows, cols], y[rows, cols].astype(np.intp), p[rows, cols]
        np.add.at(self.hist, (cols * 2 + yy) * AUC_SLOTS + eta_slot(e), 1.0)
        b = probability_bin(pp)
        np.add.at(self.ece, (cols, b, yy), 1.0)
        np.add.at(self.psum, (cols, b), pp)
        nll = np.log1p(np.exp(-np.abs(e))) + np.maximum(np.where(yy == 1, -e, e), 0.0)
        np.add.at(self.nll, cols, nll)

    def take(self, version: int, slope: float, intercepts: npt.ArrayLike) -> RoundSummary | None:
        """The open round as a summary (None if it has no step), then a fresh round."""
        if self.steps == 0:
            return None
        sketch = (
            Sketch.from_dense(self.hist, self.ece[:, :, 0], self.ece[:, :, 1], self.psum, self.nll)
            if self.sketch
            else None
        )
        out = make_summary(
            self.k,
            version=int(version),
            slope=float(slope),
            intercepts=np.asarray(intercepts, dtype=np.float64),
            info=self.info,
            grad=self.grad,
            counts=self.counts,
            steps=self.steps,
            sketch=sketch,
        )
        if self.keep_reached:
            reached = Reached.from_dense(self.reached, labelled=out.counts, steps=out.steps)
            out = dataclasses.replace(out, reached=reached)
        self.clear()
        return out
