"""Python client of the avest acceptance-estimator service.

Usage::

    import numpy as np
    from avest_client import EstimatorClient

    with EstimatorClient("127.0.0.1:50051", timeout=2.0) as client:
        reg = client.register("Qwen/Qwen3-8B", "Qwen/Qwen3-0.6B", "draft_model", k=5)
        conf, surv = client.score(reg.pair_id, features)          # float32 [R, K]
        client.set_cost_curves(reg.pair_id, [(1, 2.0), (256, 9.0)], [(1, 8.0), (4096, 60.0)])
        decision = client.budget(reg.pair_id, conf, scheduled, num_non_draft_tokens=64,
                                 num_sampling=64)                 # lossless by default

        # Stream decode steps in the background (never blocks the caller):
        fwd = client.forwarder(reg.pair_id)
        fwd.submit(features, num_verified, num_accepted)            # [R, K], [R], [R]
        fwd.latest_coefficients()   # (version, slope, intercepts) pushed by the server
        fwd.close(timeout=5.0)      # flush what it can
        print(fwd.stats)            # sent / acked / dropped / resent / reconnects

        for c in client.watch(reg.pair_id):   # or client.watch(pair_id, callback)
            ...

:class:`AsyncEstimatorClient` offers the same calls as coroutines (its
``forwarder`` runs as a task). Failures raise :class:`AvestError` subclasses
carrying the gRPC ``code`` and the server's message. Channels are created
lazily in the process that uses them, so a client built before ``fork`` is
safe to use in the child.
"""

from avest_client._stream import Backoff
from avest_client.aio import AsyncCoefficientsWatch, AsyncEstimatorClient, AsyncWatcher
from avest_client.client import CoefficientsWatch, EstimatorClient, Watcher
from avest_client.errors import (
    AvestError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from avest_client.forwarder import AsyncForwarder, Forwarder, default_worker_id
from avest_client.ledger import Ledger, Stats
from avest_client.types import (
    BudgetResult,
    Calibration,
    Coefficients,
    PairInfo,
    PairKey,
    PositionCalibration,
    Registration,
)

__all__ = [
    "AsyncCoefficientsWatch",
    "AsyncEstimatorClient",
    "AsyncForwarder",
    "AsyncWatcher",
    "AvestError",
    "Backoff",
    "BudgetResult",
    "Calibration",
    "CancelledError",
    "Coefficients",
    "CoefficientsWatch",
    "DeadlineExceededError",
    "EstimatorClient",
    "FailedPreconditionError",
    "Forwarder",
    "InvalidArgumentError",
    "Ledger",
    "NotFoundError",
    "PairInfo",
    "PairKey",
    "PositionCalibration",
    "Registration",
    "ResourceExhaustedError",
    "Stats",
    "UnavailableError",
    "Watcher",
    "default_worker_id",
]
