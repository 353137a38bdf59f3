"""Summary mode against raw mode, in one run: the shim's step, bytes on the wire, ingest.

* **Shim**: added wall time per ``step`` at B x K (``bench/shim_costs.py``):
  the shim's own work around a stand-in whose step does only vLLM's
  bookkeeping (what vLLM's kernels do, the step's features and the round's
  sums, done off the clock before each step), with fresh per-step tensors as
  vLLM allocates them and a gap after each step (the precise figure);
  ``SummaryRound.record`` alone, by reference and by copy, each round ended
  with its sums; and the CPU stand-in of vLLM's estimator
  (tests/support/standin.py), each variant interleaved with a plain estimator in
  blocks (``bench_shim._phase``): raw mode, summary mode with the on-device
  calibration sketch, summary mode without it. In-memory sinks (pooled
  coefficients govern), so only the shim's own cost is measured. Each
  variant's path is checked by count afterwards (``shim_costs.check_summaries``,
  ``check_raw``): a round summary refused on the host, a sink that received
  nothing, summaries covering no drafts or a sketch variant without sketches
  end the run with a message naming the variant (exit status 1), not a figure.
* **Bytes on the wire per worker-step**: the serialized ``ObserveRequest``
  of one raw step (B x K float32 features and the counts), against the
  serialized summary messages the summary shim produced over the same
  distinct steps, divided by the steps they cover (gRPC and HTTP/2 framing,
  about 14 bytes per message, not counted).
* **Handler**: the server's work per summary without gRPC, in this process
  (parse, ``summary_from_pb``, ``Pair.observe``), CPU µs per summary.
* **Ingest**: ``avest serve`` in a subprocess on loopback, one pair per K,
  ``--workers`` workers multiplexed over ``--streams`` Observe streams, each
  worker sending one summary (100 steps, with a sketch) per round at an
  offered rate of ``--rate`` summaries/s in total, for ``--seconds``. Reports
  the summaries acknowledged per second and the acknowledgement latency
  (from the write to the ack that covers it; acks wait for the group commit,
  ``--flush-interval-ms`` 100 by default), p50 / p99. Then the same flat out
  (five summaries per worker written back to back) for the ceiling. A run
  that leaves summaries unacknowledged gives up 120 s after its last write and
  reports them as ``unacked``. CPU seconds of the server process and of this
  client per acknowledged summary show which side is the limit.

``--baseline-server TREE`` (a checkout of the code before) runs the ingest
section on TREE's server and this tree's in turn, ``--repeats`` times each, so
the two are compared in one run. ``--ingest-only`` skips the shim sections.
The ingest section also times a bare gRPC server on this machine
(``bench/grpc_floor.py``: one stream message in, one ack out, nothing done):
the floor under any server's CPU per summary here.

    python bench/bench_summary.py [--batch 256] [--k 8] [--ingest-k 8,64] [--rate 5000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_ingest import make_steps
from bench_shim import _phase
from grpc_floor import grpc_floor
from shim_costs import (
    bench_overhead,
    bench_record,
    bench_strata_step,
    check_raw,
    check_summaries,
    compare_trees,
    print_shim_costs,
    summary_shim,
)
from shim_variants import CPU, StandinAcceptanceEstimator
from summary_ingest import (
    ROUND_STEPS,
    bench_handler,
    bench_ingest_summaries,
    print_ingest,
    summary_body,
)

from avest_wire import matrix as wire
from avest_wire.messages import summary_to_pb
from avest_wire.v1 import estimator_pb2 as pb

HERE = Path(__file__).resolve()
PAIR_ID, WORKER_ID = "0123456789abcdef", "gpu-node-17:48213:9f3a1c2e"


def torch_steps(batch: int, k: int, n: int, seed: int) -> tuple:
    """``(idx, features, sampled, rejected)`` lists: n distinct steps from bench_ingest's model,
    each with tensors of its own (as vLLM allocates them every step)."""
    g = torch.Generator().manual_seed(seed)
    idx, feats, sampled, rejected = [], [], [], []
    for x, d, a in make_steps(n, batch, k, seed):
        rej = np.minimum(np.random.default_rng(seed).integers(0, 2, batch), d - a)
        idx.append(torch.randperm(batch, generator=g).to(torch.int64))
        feats.append(torch.from_numpy(x))
        sampled.append(torch.from_numpy((a + 1).astype(np.int32)))
        rejected.append(torch.from_numpy(rej.astype(np.int32)))
    return idx, feats, sampled, rejected


def bench_shim_steps(batch: int, k: int, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    # distinct tensors for every step of a block (_phase starts each block at the first),
    # and more than a round: no round holds one tensor twice, even across blocks
    inputs = torch_steps(batch, k, max(128, steps // rounds), seed=1)
    out = {}
    for name, mode, sketch, strata in (
        ("raw", "raw", True, 0),
        ("summary + sketch", "summary", True, 0),
        ("summary, no sketch", "summary", False, 0),
        # AVEST_STRATA=1: each against its line above without strata
        ("summary + sketch, 4 strata", "summary", True, 4),
        ("summary, no sketch, 4 strata", "summary", False, 4),
    ):
        est, sink = summary_shim(mode, batch, k, sketch, strata=strata)
        plain = StandinAcceptanceEstimator(batch, k, CPU)
        rt = est._avest
        try:
            shim_t, plain_t = _phase(est, plain, inputs, steps, rounds, 0.0)
            if rt.rounds is not None and not rt.rounds.flush(60):
                raise SystemExit(f"bench: {name!r}: rounds still with the sender after 60 s")
            if rt.transfer is not None and not rt.transfer.flush(60):
                raise SystemExit(f"bench: {name!r}: steps still with the forwarder after 60 s")
        finally:
            est.avest_close()
        if rt.rounds is not None:
            check_summaries(name, sink, rt.rounds, sketch=sketch)
        else:
            check_raw(name, est, sink)
        base = statistics.median(plain_t)
        out[name] = {
            "median_us": float(np.median(shim_t)),
            "plain_median_us": base,
            "added_median_us": float(np.median(shim_t)) - base,
            "summaries": float(len(sink.summaries)),
            "sketches": float(sum(s.sketch is not None for s in sink.summaries)),
            "strata": float(len(set(sink.strata) - {None})),
        }
        if strata and out[name]["strata"] < strata:
            raise SystemExit(
                f"bench: {name!r}: summaries named {out[name]['strata']:.0f} strata, not {strata}"
            )
    return out


def bench_bytes(batch: int, k: int, steps: int) -> dict[str, float]:
    idxs, feats, sampled, rejected = torch_steps(batch, k, steps, seed=2)
    est, sink = summary_shim("summary", batch, k)
    raw_bytes = []
    for j in range(steps):
        idx = idxs[j]
        est.load_features(idx, feats[j])
        est.step(idx, sampled[j], rejected[j])
        a = np.maximum(sampled[j].numpy() - 1, 0)
        data, rows, kk = wire.encode(feats[j].numpy())
        msg = pb.ObserveRequest(
            pair_id=PAIR_ID, worker_id=WORKER_ID, sequence=j + 1, features=data, rows=rows,
            k=kk, num_verified=(a + rejected[j].numpy()).tolist(), num_accepted=a.tolist(),
            coefficients_version=1,
        )  # fmt: skip
        raw_bytes.append(msg.ByteSize())
    rounds = est._avest.rounds
    if not rounds.flush(30):
        raise SystemExit("bench: bytes: rounds still with the sender after 30 s")
    est.avest_close()
    check_summaries("bytes", sink, rounds, sketch=True)
    sizes = [
        pb.ObserveRequest(
            pair_id=PAIR_ID, worker_id=WORKER_ID, sequence=i + 1, k=k, summary=summary_to_pb(s)
        ).ByteSize()
        for i, s in enumerate(sink.summaries)
    ]
    covered = sum(s.steps for s in sink.summaries)
    per_raw = float(np.mean(raw_bytes))
    per_summary = sum(sizes) / covered
    return {
        "raw_bytes_per_step": per_raw,
        "summary_bytes_per_message": float(np.mean(sizes)),
        "summary_bytes_per_step": per_summary,
        "ratio": per_raw / per_summary,
        "summaries": len(sizes),
        "steps_covered": covered,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--bytes-steps", type=int, default=401)
    ap.add_argument("--ingest-k", default="8,64")
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rate", type=float, default=5000.0)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument(
        "--flush-interval-ms", default="100", help="group commit interval(s), e.g. 100,25"
    )
    ap.add_argument("--no-ingest", action="store_true")
    ap.add_argument("--ingest-only", action="store_true", help="the handler and ingest sections")
    ap.add_argument("--shim-only", action="store_true", help="the shim's work and record")
    # a checkout of the code before (git archive REV | tar -x -C DIR): the shim-only
    # section runs alternately on it and on this tree, --repeats times each
    ap.add_argument("--baseline-tree", type=Path)
    ap.add_argument("--repeats", type=int, default=2)
    # a checkout of the server before: the ingest section runs its server and this
    # tree's in turn, --repeats times each
    ap.add_argument("--baseline-server", type=Path)
    ap.add_argument("--gap-ms", type=float, default=0.5, help="shim's work: wait per step")
    ap.add_argument("--overhead-steps", type=int, default=3000)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.baseline_tree is not None:
        compare_trees(HERE, a.baseline_tree, a.repeats, a.batch, a.k, a.gap_ms, a.overhead_steps)
        return
    res: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg()}
    if not a.ingest_only:
        res["shim_overhead"] = bench_overhead(a.batch, a.k, a.overhead_steps, gap_s=a.gap_ms / 1e3)
        res["record"] = bench_record(a.batch, a.k)
        res["strata_step"] = bench_strata_step(a.batch, a.k)
    if not (a.shim_only or a.ingest_only):
        res["shim"] = bench_shim_steps(a.batch, a.k, a.steps, a.rounds)
        res["bytes"] = bench_bytes(a.batch, a.k, a.bytes_steps)
    if not (a.no_ingest or a.shim_only):
        ks = [int(x) for x in a.ingest_k.split(",") if x]
        res["handler"] = {f"K={k}": bench_handler(k) for k in ks}
        # one summary in ten carries its reached counts (the plugin's REACHED_EVERY)
        res["handler"][f"K={ks[0]} with reached counts"] = bench_handler(ks[0], reached=True)
        res["grpc_floor"] = grpc_floor(len(summary_body(ks[0])) + 40, min(a.streams, 16))
        res["ingest"] = {}
        # with a baseline, the two servers take turns, --repeats times each
        trees = (
            [(" baseline", a.baseline_server), ("", None)] if a.baseline_server else [("", None)]
        )
        for rep in range(a.repeats if a.baseline_server else 1):
            for tag, tree in trees:
                for ms in a.flush_interval_ms.split(","):
                    name = f"flush {ms} ms{tag}" + (f" #{rep + 1}" if a.baseline_server else "")
                    res["ingest"][name] = bench_ingest_summaries(
                        ks, a.workers, a.streams, a.rate, a.seconds, int(ms), tree
                    )
    if a.json:
        print(json.dumps(res, indent=2))
        return
    if a.ingest_only:
        print_ingest(res)
        return
    print_shim_costs(res, a.batch, a.k, a.gap_ms)
    if a.shim_only:
        return
    print(f"\nshim step at B={a.batch}, K={a.k} (CPU stand-in, interleaved)")
    print(f"{'mode':<22} {'step µs':>9} {'plain µs':>9} {'added µs':>9}")
    for name, r in res["shim"].items():
        print(
            f"{name:<22} {r['median_us']:>9.1f} {r['plain_median_us']:>9.1f} "
            f"{r['added_median_us']:>+9.1f}"
        )
    b = res["bytes"]
    print(
        f"\nbytes per worker-step: raw {b['raw_bytes_per_step']:.0f}, summary "
        f"{b['summary_bytes_per_step']:.1f} ({b['summary_bytes_per_message']:.0f} B per summary "
        f"of ~{ROUND_STEPS} steps): {b['ratio']:.0f}x fewer"
    )
    print_ingest(res)


if __name__ == "__main__":
    main()
