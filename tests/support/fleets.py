"""Fleets of workers fed into one pair's state directly (no server): honest ones from
traces split by request, and poisoners.

A fleet is a list of :class:`Sender` s, each with its own decode steps; they are
interleaved step by step (as the traces' workers ran side by side) into a
:class:`~avest.state.pairs.Pair` of a fresh :class:`~avest.state.pairs.Registry`, as raw
steps or as round summaries (each worker summarises ``summary_steps`` of its own steps
at the coefficients it holds, as the shim does). :func:`honest_acceptance` is the
target measure: the mean predicted acceptance of the final coefficients over the honest
workers' labelled drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from avest.core.estimator import Batch
from avest.core.labels import labels
from avest.core.model import Coefficients, linear_predictor
from avest.core.numeric import sigmoid
from avest.core.summary import summarise
from avest.offline.fleet import worker_steps
from avest.offline.trace import Trace
from avest.state.pairs import Pair, Registry
from avest_wire.pair import PairKey
from avest_wire.summary import RoundSummary

FloatArray = npt.NDArray[np.float64]

#: Steps a worker pools into one round summary (vLLM's refit interval).
SUMMARY_STEPS = 100


@dataclass
class Sender:
    """One worker: its id, its decode steps in order, whether it is honest, and how
    many of its steps it sends at each turn (more than one: a flood)."""

    worker: str
    steps: list[Batch]
    honest: bool = True
    burst: int = 1
    _pending: list[tuple[FloatArray, npt.NDArray[np.bool_], npt.NDArray[np.bool_]]] = field(
        default_factory=list
    )


def trace_batches(trace: Trace, workers: int, k: int | None = None) -> list[list[Batch]]:
    """Each worker's steps when ``trace`` is split by request (request r on worker
    r mod ``workers``), cut to its first ``k`` positions when given."""
    k = trace.k if k is None else k
    d = np.minimum(trace.num_verified, k)
    a = np.minimum(trace.num_accepted, d)
    observed, accepted = labels(d, a, k, None)
    x = trace.features[:, :k].astype(np.float64)
    out: list[list[Batch]] = [[] for _ in range(workers)]
    for ws in worker_steps(trace, workers):
        r = ws.rows
        out[ws.worker].append(Batch(x[r], observed[r], accepted[r]))
    return out


def worker_counts(
    trace: Trace, workers: int
) -> list[list[tuple[FloatArray, npt.NDArray[np.int32], npt.NDArray[np.int32]]]]:
    """Each worker's steps as the client submits them, ``(features, num_verified,
    num_accepted)``, when ``trace`` is split by request (request r on worker r mod W)."""
    out: list[list[tuple[FloatArray, npt.NDArray[np.int32], npt.NDArray[np.int32]]]] = [
        [] for _ in range(workers)
    ]
    for ws in worker_steps(trace, workers):
        r = ws.rows
        out[ws.worker].append(
            (trace.features[r].astype(np.float64), trace.num_verified[r], trace.num_accepted[r])
        )
    return out


def honest(trace: Trace, workers: int, prefix: str = "w", k: int | None = None) -> list[Sender]:
    return [
        Sender(f"{prefix}{i}", steps) for i, steps in enumerate(trace_batches(trace, workers, k))
    ]


def poisoner(
    like: Sender, worker: str, corrupt: Callable[[Batch], Batch], *, burst: int = 1
) -> Sender:
    """A worker sending ``like``'s steps corrupted, each ``burst`` times over (a flood)."""
    steps = [corrupt(b) for b in like.steps for _ in range(burst)]
    return Sender(worker, steps, honest=False, burst=burst)


def rejected_at_clamp(b: Batch) -> Batch:
    """Every draft at the feature clamp (x = 40), the first rejected."""
    observed = np.zeros_like(b.observed)
    observed[:, 0] = True
    return Batch(np.full_like(b.features, 40.0), observed, np.zeros_like(b.accepted))


def all_accepted(b: Batch) -> Batch:
    """Every draft verified and accepted."""
    return Batch(b.features, np.ones_like(b.observed), np.ones_like(b.accepted))


def flipped(b: Batch) -> Batch:
    """Each labelled draft's verdict the other way round."""
    return Batch(b.features, b.observed, b.observed & ~b.accepted)


def interleave(senders: list[Sender]) -> Iterator[tuple[Sender, Batch]]:
    """The senders' steps in turns: at each turn, each sender's next ``burst`` steps."""
    turns = max(len(s.steps) // s.burst for s in senders)
    for i in range(turns):
        for s in senders:
            for b in s.steps[i * s.burst : (i + 1) * s.burst]:
                yield s, b


def new_pair(k: int, refit_interval: int = 100) -> Pair:
    registry = Registry()
    pair, _ = registry.register(
        PairKey.of("target", "draft", "draft_model", k), refit_interval=refit_interval
    )
    return pair


def feed(pair: Pair, senders: list[Sender], mode: str = "raw", refit_every: int = 0) -> Pair:
    """Feed every sender's steps into ``pair`` as raw steps or round summaries.

    ``refit_every``: a full round may refit only at every this many messages (the
    service's refit interval holding rounds open while messages come faster); 0: at once.
    """
    seq: dict[str, int] = {}
    holds: dict[str, tuple[Coefficients, int]] = {}
    sent = 0

    def send(worker: str, s: int, batch: Batch | RoundSummary) -> None:
        nonlocal sent
        sent += 1
        may_refit = refit_every == 0 or sent % refit_every == 0
        pair.observe(worker, s, batch, may_refit=may_refit)
        if may_refit:
            pair.refit_held()

    for s, b in interleave(senders):
        seq[s.worker] = seq.get(s.worker, 0) + 1
        if mode == "raw":
            send(s.worker, seq[s.worker], b)
            continue
        if not s._pending:
            holds[s.worker] = (pair.coefficients, pair.estimator.version)
        s._pending.append((b.features, b.observed, b.accepted))
        if len(s._pending) >= SUMMARY_STEPS:
            send(s.worker, seq[s.worker], _summary(s, holds[s.worker]))
    for s in senders:
        if s._pending:
            send(s.worker, seq[s.worker] + 1, _summary(s, holds[s.worker]))
    return pair


def _summary(s: Sender, hold: tuple[Coefficients, int]) -> RoundSummary:
    at, version = hold
    summary = summarise(s._pending, at, version)
    s._pending = []
    return summary


def honest_acceptance(coefficients: Coefficients, senders: list[Sender]) -> float:
    """Mean predicted acceptance of ``coefficients`` over the honest senders' labelled drafts."""
    total, count = 0.0, 0
    for s in senders:
        if not s.honest:
            continue
        for b in s.steps:
            p = sigmoid(linear_predictor(coefficients, b.features))
            total += float(p[b.observed].sum())
            count += int(b.observed.sum())
    return total / count
