"""Drive an estimator from a recorded trace (``avest-trace/1``) or synthetic rows, step by
step as vLLM's speculator does; the core estimator fed the same rows, to compare with."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from avest.core.estimator import OnlineEstimator
from avest.settings import Settings
from tests.support import traces

#: The shared chat trace next to the repository (as tests/conftest.py finds it); tests
#: fall back to a synthetic trace when it is absent.
TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "chat-rtn4g32-t1.0-k5.npz"


#: Request slots of the estimators these tests drive (vLLM's ``max_num_reqs``).
MAX_REQS = 32


@dataclass
class Step:
    idx_mapping: torch.Tensor  # int64 [R] request-state slots
    features: torch.Tensor  # float32 [R, K]
    num_sampled: torch.Tensor  # int32 [R], vLLM's form: accepted + 1 bonus
    num_rejected: torch.Tensor  # int32 [R]: verified - accepted
    num_verified: np.ndarray  # the trace's own wire form, for comparison
    num_accepted: np.ndarray

    def to(self, device: str | torch.device) -> Step:
        return Step(
            self.idx_mapping.to(device),
            self.features.to(device),
            self.num_sampled.to(device),
            self.num_rejected.to(device),
            self.num_verified,
            self.num_accepted,
        )


def load_trace(path: Path = TRACE) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    with np.load(path, allow_pickle=False) as d:
        return {k: d[k] for k in ("features", "num_verified", "num_accepted", "step", "request")}


def synthetic_trace(steps: int, batch: int, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Rows with a known logistic ground truth; requests churn so slots get reused."""
    rng = np.random.default_rng(seed)
    rows = []
    next_req, live = 0, []
    for s in range(steps):
        while len(live) < batch:
            live.append(next_req)
            next_req += 1
        if s % 7 == 3:
            live.pop(int(rng.integers(len(live))))
        for r in live:
            rows.append((s, r))
    n = len(rows)
    x = rng.normal(1.0, 2.0, size=(n, k)).astype(np.float32)
    p = 1 / (1 + np.exp(-(0.55 * x - 0.1 - 0.15 * np.arange(k))))
    acc = rng.random((n, k)) < p
    num_accepted = np.argmin(np.concatenate([acc, np.zeros((n, 1), bool)], 1), axis=1)
    num_verified = rng.integers(0, k + 1, size=n)
    num_accepted = np.minimum(num_accepted, num_verified)
    arr = np.array(rows)
    return {
        "features": x,
        "num_verified": num_verified.astype(np.int32),
        "num_accepted": num_accepted.astype(np.int32),
        "step": arr[:, 0].astype(np.int64),
        "request": arr[:, 1].astype(np.int64),
    }


def steps(trace: dict[str, np.ndarray], max_num_reqs: int) -> Iterator[Step]:
    """Per decode step, with request ids mapped to stable, reused slots (scrambled order)."""
    slot_of: dict[int, int] = {}
    free = list(range(max_num_reqs))[::-1]
    bounds = np.flatnonzero(np.diff(trace["step"])) + 1
    for chunk in np.split(np.arange(trace["step"].shape[0]), bounds):
        reqs = trace["request"][chunk]
        for gone in set(slot_of) - set(reqs.tolist()):
            free.append(slot_of.pop(gone))
        for r in reqs.tolist():
            if r not in slot_of:
                slot_of[r] = free.pop(0 if r % 2 else -1)
        a = trace["num_accepted"][chunk]
        d = trace["num_verified"][chunk]
        yield Step(
            idx_mapping=torch.tensor([slot_of[r] for r in reqs.tolist()], dtype=torch.int64),
            features=torch.from_numpy(trace["features"][chunk].copy()),
            num_sampled=torch.from_numpy((a + 1).astype(np.int32)),
            num_rejected=torch.from_numpy((d - a).astype(np.int32)),
            num_verified=d.astype(np.int32),
            num_accepted=a.astype(np.int32),
        )


def drive(est, step: Step) -> None:  # noqa: ANN001
    """What one decode step does to the estimator: propose wrote features, then step grades them."""
    est.load_features(step.idx_mapping, step.features)
    est.step(step.idx_mapping, step.num_sampled, step.num_rejected)


def run(est, trace: list[Step]) -> None:  # noqa: ANN001
    """Every step of ``trace`` in order, as vLLM's speculator makes them (:func:`drive`)."""
    for s in trace:
        drive(est, s)


def trace_steps(trace: traces.Trace) -> list[Step]:
    """A recorded trace as decode steps over ``MAX_REQS`` request slots."""
    arrays = {n: getattr(trace, n) for n in ("features", "num_verified", "num_accepted")}
    arrays.update(step=trace.step, request=trace.request)
    return list(steps(arrays, MAX_REQS))


def core_replay(
    trace: list[Step], k: int, rule: str, refit_interval: int, settings: Settings
) -> OnlineEstimator:
    """:func:`tests.support.traces.core_replay` fed these steps' own rows."""
    rows = [(s.features.numpy(), s.num_verified, s.num_accepted) for s in trace]
    return traces.core_replay(rows, k, rule, refit_interval, settings)
