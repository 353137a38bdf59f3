"""One TP rank for test_shim_tp (runs in a spawned process; gloo on CPU)."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from avest_client.types import Served
from avest_client.vllm import strata
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.estimator import make_sidecar_estimator
from avest_client.vllm.tp import TorchDistGroup
from tests.support.standin import StandinAcceptanceEstimator
from tests.support.tracedrive import drive, steps, synthetic_trace

from .fakes import FakeSink, FakeSinkFactory

K = 4
SYNC = 8
STEPS = 130


class FastRefit(StandinAcceptanceEstimator):
    REFIT_INTERVAL = 25


def script(sink: FakeSink, i: int, with_strata: bool = False) -> None:
    """Rank 0's sidecar, changing between steps at times no other rank can know."""
    if with_strata and i == 5:
        sink.strata = {"greedy": Served(1.2, (0.5, 0.2, 0.0, -0.3), version=1)}
    if with_strata and i == 101:
        sink.strata = {"t0.5-1": Served(0.4, (0.1, 0.0, -0.1, -0.2), version=4)}
    if i == 5:
        sink.push(1, 0.6, [0.3, 0.1, -0.1, -0.3])
    elif i == 20:
        sink.push(2, 0.65, [0.4, 0.2, 0.0, -0.2])
    elif i == 45:
        sink.is_connected = False
    elif i == 70:
        sink.is_connected = True
        sink.push(3, 0.55, [0.1, 0.0, -0.1, -0.2])
    elif i == 101:
        sink.push(4, 0.52, [0.0, -0.1, -0.2, -0.3])


def run(
    rank: int,
    world: int,
    init_file: str,
    out_dir: str,
    sink_fails: bool = False,
    with_strata: bool = False,
) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        sink = FakeSink(connected=True)
        factory = FakeSinkFactory(sink, error=RuntimeError("no sidecar") if sink_fails else None)
        cls = make_sidecar_estimator(
            FastRefit,
            factory,
            config=ShimConfig(sync_steps=SYNC, queue_size=256, mode="raw", strata=with_strata),
            group_resolver=TorchDistGroup,
        )
        est = cls(32, K, torch.device("cpu"))
        if with_strata:  # every rank admits the same requests: even slots greedy, odd T = 0.8
            for slot in range(32):
                t = 0.0 if slot % 2 == 0 else 0.8
                strata.REGISTRY.record(slot, SimpleNamespace(temperature=t))
        trace = list(steps(synthetic_trace(steps=STEPS, batch=10, k=K, seed=11), 32))
        rng = random.Random(rank)
        log = []
        for i, s in enumerate(trace):
            if rank == 0:
                script(sink, i, with_strata)
            else:
                time.sleep(rng.random() * 0.004)  # ranks drift apart between collectives
            drive(est, s)
            conf = None
            if with_strata:  # the confidences a draft graph would read, every rank
                probe = torch.zeros(32, K)
                logits = torch.linspace(-2.0, 3.0, 32 * 3).reshape(32, 3)
                est.predict(logits, torch.arange(32), torch.tensor(1), probe, torch.ones(32))
                conf = probe[:, 1].tolist()
            st = est.avest_stats()
            log.append(
                {
                    "step": i,
                    "slope": est.slope.item(),
                    "intercepts": est.intercepts.tolist(),
                    "governed": st["governed"],
                    "version": st["version"],
                    "refits": est._refits,
                    "conf": conf,
                    "served": st["strata"]["served"] if with_strata else None,
                }
            )
        if est._avest.transfer is not None:
            est._avest.transfer.flush(10)
        result = {
            "log": log,
            "factory_calls": len(factory.calls),
            "forwarded": len(sink.snapshot()),
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()
