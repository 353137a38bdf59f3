"""Mixed streams of two sampling strata, as the strata tests send them, and the core's
StratifiedEstimator fed the same steps (what the service must match)."""

from __future__ import annotations

import numpy as np

from avest.core.estimator import Batch, OnlineEstimator, make_batch
from avest.core.rule_factory import make_rule, rule_options
from avest.core.strata import StratifiedEstimator
from avest_wire import matrix as wire
from avest_wire.messages import set_step_strata
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.rpc import observe_request

K = 4
INTERVAL = 10
#: Each stratum's true acceptance model: greedy sharper and likelier than T = 0.7.
TRUTH = {"greedy": (1.0, 0.8), "t0.5-1": (0.6, -0.4)}


def mixed_steps(
    seed: int, n: int, rows: int = 8
) -> list[tuple[np.ndarray, list[int], list[int], list[str]]]:
    """``n`` decode steps, half of each step's rows greedy and half at T = 0.7."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(1.0, 1.5, size=(rows, K))
        names = [("greedy", "t0.5-1")[r % 2] for r in range(rows)]
        accepted = []
        for r, name in enumerate(names):
            slope, intercept = TRUTH[name]
            p = 1 / (1 + np.exp(-(slope * x[r] + intercept)))
            ok = rng.random(K) < p
            accepted.append(int(np.argmin(ok)) if not ok.all() else K)
        out.append((x.astype(np.float32), [K] * rows, accepted, names))
    return out


def strata_messages(
    pair_id: str, steps, *, strata: bool = True, worker: str = "w0", first: int = 1
):
    msgs = []
    for i, (x, verified, accepted, names) in enumerate(steps):
        req = observe_request(pair_id, worker, first + i, x, verified, accepted)
        if strata:
            set_step_strata(req, names)
        msgs.append(req)
    return msgs


def batch_of(req: pb.ObserveRequest) -> Batch:
    x = wire.decode(req.features, req.rows, req.k)
    return make_batch(
        x, np.asarray(req.num_verified, dtype=np.int64), np.asarray(req.num_accepted), K
    )


def core_strata(msgs: list[pb.ObserveRequest]) -> StratifiedEstimator:
    """The core's StratifiedEstimator fed the same steps, with the service's pair settings."""
    pooled = OnlineEstimator(
        K,
        make_rule("tracking", **rule_options("tracking", 0.95, 1.0)),
        refit_interval=INTERVAL,
        calibrate=True,
    )
    est = StratifiedEstimator(pooled)
    for req in msgs:
        names = [req.strata[i] for i in req.stratum_index]
        if names:
            est.apply(batch_of(req), names)
        else:
            pooled.apply(batch_of(req))
    return est
