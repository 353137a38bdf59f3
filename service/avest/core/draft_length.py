"""How many drafts to propose: the best fixed length per concurrency, in closed form.

With ``r_i`` the acceptance rate of position ``i`` given that every earlier
draft was accepted (what the estimator's per-position predictions measure),
a request verifying ``v`` drafts emits ``1 + sum_{i<v} prod_{j<=i} r_j``
tokens per step on average. At concurrency ``C`` a step costs the drafting of
``v`` positions plus ``verify_cost[C + C v]``; the best ``v`` maximises tokens
per ms. Drafting cost depends on the drafter:

* autoregressive (``per_position``): ``v`` draft passes, each ``draft_cost[C] / K``
  when the curve is the cost of a whole proposal of ``K`` (as vLLM profiles it);
* parallel: one pass for the whole proposal, ``draft_cost[C]``, whatever ``v``;
* ``v = 0`` (speculation off) drafts nothing.

This is a fixed-length model (no trimming): what ``num_speculative_tokens``
to run without adaptive verification, and the floor that adaptive
verification must beat.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from avest.core.costs import CostTable
from avest_wire.errors import InvalidInput

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True)
class LengthChoice:
    """The best fixed length at one concurrency, with every length's throughput."""

    concurrency: int
    length: int
    throughput: tuple[float, ...]  # tokens per second, by length 0..K

    @property
    def gain_over_off(self) -> float:
        """The best length's throughput against speculation off, minus 1."""
        return self.throughput[self.length] / self.throughput[0] - 1.0


def expected_tokens(rates: npt.ArrayLike) -> FloatArray:
    """Tokens per request per step when verifying ``v = 0..K`` drafts: ``[K + 1]``."""
    r = np.asarray(rates, dtype=np.float64)
    if r.ndim != 1 or not np.all((r >= 0.0) & (r <= 1.0)):
        raise InvalidInput("rates", "must be K probabilities in [0, 1]")
    return np.asarray(1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(r)))), dtype=np.float64)


def draft_ms(
    costs: CostTable,
    concurrency: int,
    lengths: npt.ArrayLike,
    *,
    per_position: bool,
    proposal_length: int,
) -> FloatArray:
    """Drafting cost (ms) of a step of ``concurrency`` requests drafting each of ``lengths``.

    ``costs.draft_cost(C)`` is a proposal of ``proposal_length`` drafts: with
    ``per_position`` a length ``v`` pays ``v`` of its ``1 / proposal_length``
    shares, otherwise (a parallel drafter) the whole proposal; ``0`` drafts nothing.
    """
    v = np.asarray(lengths, dtype=np.float64)
    draft = float(costs.draft_cost(int(concurrency)))
    per_step = v * draft / proposal_length if per_position else np.full_like(v, draft)
    return np.asarray(np.where(v == 0, 0.0, per_step), dtype=np.float64)


def best_lengths(
    rates: npt.ArrayLike,
    costs: CostTable,
    concurrencies: Iterable[int],
    *,
    per_position: bool,
    proposal_length: int | None = None,
) -> list[LengthChoice]:
    """The best fixed ``num_speculative_tokens`` (``0..K``) at each concurrency.

    ``costs.draft_cost(C)`` is the proposal of ``proposal_length`` drafts
    (default ``K = len(rates)``); with ``per_position`` one position costs
    that over ``proposal_length``.
    """
    tokens = expected_tokens(rates)
    k = tokens.shape[0] - 1
    per = proposal_length if proposal_length is not None else k
    if per < 1:
        raise InvalidInput("proposal_length", f"must be >= 1, got {per}")
    out = []
    for c in concurrencies:
        if int(c) != c or c < 1:
            raise InvalidInput("concurrency", f"must be a positive integer, got {c!r}")
        c = int(c)
        lengths = np.arange(k + 1)
        drafting = draft_ms(costs, c, lengths, per_position=per_position, proposal_length=per)
        verify_ms = np.asarray(costs.verify_cost(c + c * lengths), dtype=np.float64)
        throughput = 1000.0 * c * tokens / (drafting + verify_ms)
        out.append(LengthChoice(c, int(np.argmax(throughput)), tuple(float(t) for t in throughput)))
    return out


def rates_from_predictions(mean_predicted: Sequence[float]) -> FloatArray:
    """Per-position rates from mean predictions; a position never seen counts as 0."""
    r = np.asarray(mean_predicted, dtype=np.float64)
    return np.asarray(np.where(np.isfinite(r), np.clip(r, 0.0, 1.0), 0.0), dtype=np.float64)
