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
        fwd.latest_coefficients()   # Coefficients(slope, intercepts, version=...) pushed
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

# Imported on first use (PEP 562): the vLLM plugin imports this package in
# every vLLM process, and only the workers that stream need grpc and the wire
# code.
_EXPORTS = {
    "AsyncCoefficientsWatch": "avest_client.aio",
    "AsyncEstimatorClient": "avest_client.aio",
    "AsyncForwarder": "avest_client.forwarder",
    "AsyncWatcher": "avest_client.aio",
    "AvestError": "avest_client.errors",
    "Backoff": "avest_client._stream",
    "BudgetResult": "avest_client.types",
    "Calibration": "avest_client.types",
    "CancelledError": "avest_client.errors",
    "Coefficients": "avest_client.types",
    "CoefficientsWatch": "avest_client.watch",
    "Credentials": "avest_client.credentials",
    "DeadlineExceededError": "avest_client.errors",
    "EstimatorClient": "avest_client.client",
    "FailedPreconditionError": "avest_client.errors",
    "Forwarder": "avest_client.forwarder",
    "InvalidArgumentError": "avest_client.errors",
    "Ledger": "avest_client.ledger",
    "NotFoundError": "avest_client.errors",
    "PairInfo": "avest_client.types",
    "PairsPage": "avest_client.types",
    "PairKey": "avest_wire.pair",
    "PositionCalibration": "avest_client.types",
    "PermissionDeniedError": "avest_client.errors",
    "Registration": "avest_client.types",
    "Served": "avest_client.types",
    "Schedule": "avest_client.types",
    "ScheduleRange": "avest_client.types",
    "ResourceExhaustedError": "avest_client.errors",
    "Stats": "avest_client.ledger",
    "UnauthenticatedError": "avest_client.errors",
    "UnavailableError": "avest_client.errors",
    "Watcher": "avest_client.watch",
    "WorkerIdCollisionError": "avest_client.errors",
    "WorkerIdReusedError": "avest_client.errors",
    "default_worker_id": "avest_client.forwarder",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'avest_client' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
    "Credentials",
    "DeadlineExceededError",
    "EstimatorClient",
    "FailedPreconditionError",
    "Forwarder",
    "InvalidArgumentError",
    "Ledger",
    "NotFoundError",
    "PairInfo",
    "PairsPage",
    "PairKey",
    "PositionCalibration",
    "PermissionDeniedError",
    "Registration",
    "Served",
    "Schedule",
    "ScheduleRange",
    "ResourceExhaustedError",
    "Stats",
    "UnauthenticatedError",
    "UnavailableError",
    "Watcher",
    "WorkerIdCollisionError",
    "WorkerIdReusedError",
    "default_worker_id",
]
