"""Traces for the tests: real ones (shared or bundled) and synthetic ones with known truth.

- :func:`load_trace` (``name``): ``"sample"`` (the bundled slice of the chat trace,
  always available), ``"chat"`` / ``"code"`` (the shared traces in ``../shared/traces``
  next to the repository; the test is skipped when they are absent), or a file name in
  that directory.
- :func:`make_synthetic_trace`: a trace drawn from the logistic model, its truth in
  ``meta["truth"]``.

Loaded traces are cached per process and their arrays are read-only, so a test that
needs to modify one must copy it first.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from avest.core.estimator import OnlineEstimator
from avest.core.numeric import sigmoid
from avest.core.rule_factory import make_rule, rule_options
from avest.offline.trace import FORMAT, Trace, bundled_sample_path, read_trace
from avest.settings import Settings

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACES_DIR = REPO_ROOT.parent / "shared" / "traces"
SHARED_TRACES = {
    "chat": "chat-rtn4g32-t1.0-k5.npz",
    "code": "code-rtn4g128-t0.7-k6.npz",
}


def trace_path(name: str) -> Path:
    """Path of a named trace: ``"sample"``, ``"chat"``, ``"code"`` or a shared file name."""
    if name == "sample":
        return bundled_sample_path()
    return SHARED_TRACES_DIR / SHARED_TRACES.get(name, name)


@functools.cache
def _load(path: Path) -> Trace:
    trace = read_trace(path)
    for a in (trace.features, trace.num_verified, trace.num_accepted, trace.step, trace.request):
        a.flags.writeable = False
    for a in trace.optional_arrays().values():
        a.flags.writeable = False
    return trace


def load_trace(name: str) -> Trace:
    """A named trace (cached, read-only arrays); skips the test if a shared one is absent."""
    path = trace_path(name)
    if not path.is_file():
        pytest.skip(f"trace not available: {path}")
    return _load(path)


def make_synthetic_trace(
    steps: int = 200,
    requests: int = 16,
    k: int = 5,
    slope: float = 0.5,
    intercepts: float | Sequence[float] | None = None,
    seed: int = 0,
    *,
    num_verified: int | None = None,
    steps_per_request: int | None = None,
    feature_shift: float = -2.5,
    feature_shape: float = 1.5,
    feature_scale: float = 1.7,
) -> Trace:
    """A trace drawn from the logistic model, with the truth recorded.

    Each of ``requests`` concurrent slots drafts ``k`` positions per step.
    Features are ``feature_shift + Gamma(feature_shape, feature_scale)``
    (skewed like the real traces: mean ~0, sd ~2, long right tail), clamped
    to +-40 and stored as float32. Each position is accepted independently
    with probability ``sigmoid(slope * x + intercepts[i])`` (computed from the
    stored float32 feature), and the accepted prefix is the number of leading
    successes: the same observed-label distribution as sequential
    verification stopping at the first rejection.

    ``intercepts`` defaults to ``linspace(0.5, -0.5, k)``; a scalar is used
    for every position. ``num_verified`` (default ``k``) trims every row to
    its first drafts (the prefix is capped there). ``steps_per_request``
    replaces each slot's request id with a fresh one after that many steps.

    Returns a validated :class:`Trace`; ``meta["truth"]`` holds the slope and
    intercepts, and ``accept_rate_dist`` the true acceptance probability of
    every draft.
    """
    if intercepts is None:
        b = np.linspace(0.5, -0.5, k)
    else:
        b = np.broadcast_to(np.asarray(intercepts, dtype=np.float64), (k,)).copy()
    d = k if num_verified is None else int(num_verified)
    rng = np.random.default_rng(seed)
    rows = steps * requests
    x = feature_shift + rng.gamma(feature_shape, feature_scale, size=(rows, k))
    features = np.clip(x, -40.0, 40.0).astype(np.float32)
    p = sigmoid(slope * features.astype(np.float64) + b)
    success = rng.random((rows, k)) < p
    # Leading successes: index of the first failure, or k if none.
    leading = np.where(success.all(axis=1), k, np.argmin(success, axis=1))
    step = np.repeat(np.arange(steps, dtype=np.int64), requests)
    slot = np.tile(np.arange(requests, dtype=np.int64), steps)
    request = slot + requests * (step // steps_per_request) if steps_per_request else slot
    meta = {
        "format": FORMAT,
        "target": "synthetic",
        "draft": "synthetic",
        "method": "synthetic-logistic",
        "num_speculative_tokens": k,
        "temperature": 1.0,
        "top_p": 1.0,
        "truth": {"slope": float(slope), "intercepts": [float(v) for v in b]},
        "seed": seed,
        "note": "drawn from p = sigmoid(slope * x + intercepts[i]); accepted prefix = leading successes",
    }
    trace = Trace(
        features=features,
        num_verified=np.full(rows, d, dtype=np.int32),
        num_accepted=np.minimum(leading, d).astype(np.int32),
        step=step,
        request=request,
        meta=meta,
        accept_rate_dist=p.astype(np.float32),
    )
    return trace.validate()


#: One decode step as the client takes it: ``(features, num_verified, num_accepted)``.
Step = tuple[np.ndarray, np.ndarray, np.ndarray]


def trace_steps(trace: Trace) -> list[Step]:
    """``(features, num_verified, num_accepted)`` per decode step of a trace."""
    return [(s.features, s.num_verified, s.num_accepted) for s in trace.steps()]


def core_replay(
    steps: list[Step], k: int, rule: str, refit_interval: int, settings: Settings
) -> OnlineEstimator:
    """The in-process estimator the service builds for a pair, fed the same steps."""
    est = OnlineEstimator(
        k,
        make_rule(rule, **rule_options(rule, settings.forgetting, settings.prior)),
        refit_interval=refit_interval,
        calibrate=True,
    )
    for x, d, a in steps:
        est.observe(x, d, a)
    return est


def replay_core(trace: Trace, rule: object, n: int, calibrate: bool = False) -> OnlineEstimator:
    """An estimator with ``rule`` (a rule object) refitting every ``n`` steps, fed the
    trace's decode steps in order: what ``avest evaluate`` scores for one method."""
    est = OnlineEstimator(trace.k, rule, n, calibrate=calibrate)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(trace.step)) + 1, [trace.rows]))
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        est.observe(trace.features[lo:hi], trace.num_verified[lo:hi], trace.num_accepted[lo:hi])
    return est
