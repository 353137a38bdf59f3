"""A server's gRPC API driven by a raw stub: pairs registered from a trace or by K, and
Observe streams of random steps, with the acknowledged sequence read back."""

from __future__ import annotations

import grpc
import numpy as np

from avest.offline.replay import pair_key, step_bounds
from avest.offline.trace import Trace
from avest_wire import matrix as wire
from avest_wire.rules import UPDATE_RULES
from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc


def stub_for(address: str) -> tuple[grpc.Channel, pb_grpc.EstimatorServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, pb_grpc.EstimatorServiceStub(channel)


def register(stub, trace, rule="recursive", refit_interval=10, labels=None):
    key = pair_key(trace)
    if labels:
        key.labels.update(labels)
    return stub.RegisterPair(
        pb.RegisterPairRequest(
            key=key, update_rule=UPDATE_RULES[rule], refit_interval=refit_interval
        ),
        timeout=10,
    )


def messages_for(
    trace: Trace, pair_id: str, worker: int, workers: int, worker_id: str, repeat: int
) -> list[pb.ObserveRequest]:
    """The Observe messages one of ``workers`` simulated workers sends, in order: each
    trace step's rows split among the workers, sequence numbers from 1."""
    out = []
    seq = 0
    for _ in range(repeat):
        for lo, hi in step_bounds(trace):
            chunk = np.array_split(np.arange(lo, hi), workers)[worker]
            if chunk.size == 0:
                continue
            sl = slice(int(chunk[0]), int(chunk[-1]) + 1)
            data, rows, k = wire.encode(trace.features[sl])
            seq += 1
            out.append(
                pb.ObserveRequest(
                    pair_id=pair_id,
                    worker_id=worker_id,
                    sequence=seq,
                    features=data,
                    rows=rows,
                    k=k,
                    num_verified=trace.num_verified[sl].tolist(),
                    num_accepted=trace.num_accepted[sl].tolist(),
                )
            )
    return out


def observe_all(stub, msgs):
    """Stream messages; return the highest acknowledged sequence and the updates."""
    acked, updates = 0, []
    for resp in stub.Observe(iter(msgs), timeout=60):
        if resp.HasField("ack"):
            acked = max(acked, resp.ack.acked_sequence)
        else:
            updates.append(resp.coefficients_update.coefficients.version)
    return acked, updates


def synthetic_steps(pair_id: str, worker: str, k: int, steps: int, seed: int, rows: int = 8):
    """``steps`` Observe messages of random drafts for a K-position pair."""
    rng = np.random.default_rng(seed)
    out = []
    for seq in range(1, steps + 1):
        data, r, kk = wire.encode(rng.normal(0.0, 2.0, size=(rows, k)).astype(np.float32))
        d = rng.integers(0, k + 1, size=rows)
        a = np.minimum(rng.integers(0, k + 1, size=rows), d)
        out.append(
            pb.ObserveRequest(
                pair_id=pair_id, worker_id=worker, sequence=seq, features=data, rows=r, k=kk,
                num_verified=d.tolist(), num_accepted=a.tolist(),
            )
        )  # fmt: skip
    return out


def register_k(stub, k: int, n: int, refit_interval: int = 10) -> pb.RegisterPairResponse:
    key = pb.PairKey(
        target_model="target", draft_model="draft", method="draft_model",
        num_speculative_tokens=k, labels={"n": str(n)},
    )  # fmt: skip
    return stub.RegisterPair(
        pb.RegisterPairRequest(
            key=key, update_rule=pb.UPDATE_RULE_RECURSIVE, refit_interval=refit_interval
        )
    )


def zero_step(pair_id: str, worker: str, seq: int, k: int, rows: int) -> pb.ObserveRequest:
    """An Observe message of ``rows`` all-zero feature rows, every draft verified and
    only the first accepted: cheap to send and to fold, for load and fairness tests."""
    return pb.ObserveRequest(
        pair_id=pair_id,
        worker_id=worker,
        sequence=seq,
        features=wire.encode(np.zeros((rows, k)))[0],
        rows=rows,
        k=k,
        num_verified=[k] * rows,
        num_accepted=[1] * rows,
    )
