"""``bench_abuse.py heavy``: one stream sending 2 MiB steps (8,192 rows x K = 64,
the largest allowed) flat out while /healthz and GetCoefficients are probed every
50 ms; their latency with every step folded on the event loop
(``--fold-thread-cells 0``) and with heavy steps folded on a worker thread (the
default), in one run."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
from serve_proc import WORKER_TOKEN, serve

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.rpc import random_step

WORKER = (("authorization", f"Bearer {WORKER_TOKEN}"),)


def _heavy_step(pid: str, seq: int, rows: int = 8192, k: int = 64) -> pb.ObserveRequest:
    return random_step(pid, "heavy", seq, rows, k, seed=seq)


def heavy_once(fold_thread_cells: int | None, seconds: float = 15.0) -> dict[str, Any]:
    extra = [] if fold_thread_cells is None else ["--fold-thread-cells", str(fold_thread_cells)]
    served = serve(Path(tempfile.mkdtemp(prefix="avest-heavy-")), extra)
    try:
        with grpc.insecure_channel(served.grpc_address) as ch:
            stub = pb_grpc.EstimatorServiceStub(ch)
            k64 = pb.PairKey(
                target_model="heavy", draft_model="d", method="m", num_speculative_tokens=64
            )
            pid = stub.RegisterPair(pb.RegisterPairRequest(key=k64), metadata=WORKER).pair_id
        steps = [_heavy_step(pid, s) for s in range(1, 9)]
        stop = time.monotonic() + seconds

        def gen():  # noqa: ANN202
            seq = 0
            while time.monotonic() < stop:
                msg = steps[seq % len(steps)]
                seq += 1
                msg.sequence = seq
                yield msg

        sent = {"acked": 0}

        def sender() -> None:
            with grpc.insecure_channel(
                served.grpc_address, options=[("grpc.max_send_message_length", 4 << 20)]
            ) as ch:
                stub = pb_grpc.EstimatorServiceStub(ch)
                for resp in stub.Observe(gen(), metadata=WORKER, timeout=seconds + 60):
                    if resp.HasField("ack"):
                        sent["acked"] = resp.ack.acked_sequence

        thread = threading.Thread(target=sender)
        thread.start()
        time.sleep(1.0)
        health: list[float] = []
        coeffs: list[float] = []
        with (
            grpc.insecure_channel(served.grpc_address) as ch,
            httpx.Client(base_url=served.http_url, timeout=30) as http,
        ):
            stub = pb_grpc.EstimatorServiceStub(ch)
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                http.get("/healthz")
                t1 = time.perf_counter()
                stub.GetCoefficients(
                    pb.GetCoefficientsRequest(pair_id=pid), metadata=WORKER, timeout=30
                )
                t2 = time.perf_counter()
                health.append(t1 - t0)
                coeffs.append(t2 - t1)
                time.sleep(0.05)
        thread.join(seconds + 90)
        h, c = np.array(health) * 1000, np.array(coeffs) * 1000

        def stats(a: np.ndarray) -> dict[str, float]:
            return {
                "p50": round(float(np.percentile(a, 50)), 1),
                "p99": round(float(np.percentile(a, 99)), 1),
                "max": round(float(a.max()), 1),
            }

        return {
            "fold_thread_cells": "default" if fold_thread_cells is None else fold_thread_cells,
            "steps_acked": sent["acked"],
            "probes": len(health),
            "healthz_ms": stats(h),
            "get_coefficients_ms": stats(c),
        }
    finally:
        served.stop()


def heavy() -> dict[str, Any]:
    return {"on_loop": heavy_once(0), "on_threads": heavy_once(None)}
