"""SIGTERM with many unsaved K = 64 pairs: how long until the process has exited.

``avest serve`` runs in a subprocess with a long flush interval, so that after
registering N pairs and applying one step (32 requests) to each on one open
Observe stream, almost every pair is dirty. Then SIGTERM; the report gives the
time from the signal to the exit, against the grace period, how many pairs'
steps were acknowledged by the final snapshot, and how many pairs a restart
finds with their step stored (never fewer than acknowledged).

Usage: python bench/bench_shutdown.py [--pairs 1024] [--grace-s 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from serve_proc import serve

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import observe_request

K = 64


def spawn(data_dir: str, *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    served = serve(Path(data_dir), extra, tokens=False)
    return served.proc, served.grpc_address


def step(pair_id: str, seed: int) -> pb.ObserveRequest:
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 2.0, size=(32, K)).astype(np.float32)
    d = rng.integers(0, K + 1, size=32)
    return observe_request(pair_id, "w", 1, x, d, np.minimum(rng.integers(0, K + 1, 32), d))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=1024)
    ap.add_argument("--grace-s", type=float, default=5.0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    data = tempfile.mkdtemp(prefix="avest-bench-shutdown-")
    proc, address = spawn(
        data, "--flush-interval-ms", "600000", "--grace-s", str(args.grace_s),
        "--max-pairs", str(max(1024, args.pairs)),
    )  # fmt: skip
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.EstimatorServiceStub(channel)
    ids = []
    for n in range(args.pairs):
        key = pb.PairKey(
            target_model="t", draft_model="d", method="m", num_speculative_tokens=K,
            labels={"n": str(n)},
        )  # fmt: skip
        ids.append(stub.RegisterPair(pb.RegisterPairRequest(key=key, refit_interval=1000)).pair_id)
    done = threading.Event()
    acks: set[str] = set()

    def requests():
        for n, pid in enumerate(ids):
            yield step(pid, n)
        done.wait(600)

    def read() -> None:
        try:
            for resp in stub.Observe(requests(), timeout=600):
                if resp.HasField("ack"):
                    acks.add(resp.ack.pair_id)
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while stub.GetPair(pb.GetPairRequest(pair_id=ids[-1])).pair.steps_observed < 1:
        time.sleep(0.05)
    before = len(acks)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(600)
    took = time.monotonic() - t0
    done.set()
    reader.join(10)
    channel.close()
    proc, address = spawn(data)
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.EstimatorServiceStub(channel)
    stored = sum(p.steps_observed for p in stub.ListPairs(pb.ListPairsRequest()).pairs)
    channel.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(600)
    out = {
        "pairs": args.pairs,
        "k": K,
        "grace_s": args.grace_s,
        "sigterm_to_exit_s": round(took, 2),
        "exit_code": rc,
        "acked_before_sigterm": before,
        "acked_in_total": len(acks),
        "stored_after_restart": stored,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}: {v}")


if __name__ == "__main__":
    main()
