"""Scrapes against RPCs, and memory per pair, on one server with many pairs.

One run, one table:

* **Scrape vs GetCoefficients**: ``avest serve`` in a subprocess with P pairs
  (default 1,024, K = 8), each fed a few steps so every calibration state is
  populated. ``GetCoefficients`` round trips (sync client, sequential) are
  timed idle, then while another thread scrapes ``/metrics`` back to back.
  Reported: p50/p99 of both, the ratio of the p99s (target: at most 2), and
  the scrape's own duration and size.
* **Memory per pair**: the server's resident set before and after registering
  P pairs and feeding each five steps of B = 64 rows, for K = 8 and K = 64
  (fresh servers); the bytes the registry holds per pair for the same work
  (tracemalloc, in this process: no allocator slack, no other traffic); and
  the snapshot bytes one pair writes per save.

``--baseline PATH`` repeats the scrape table with a server from another
source tree (e.g. an export of main), in the same run, after this tree's.

Usage: python bench/bench_scrape.py [--pairs 1024] [--calls 2000] [--baseline PATH] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ingest import (  # noqa: E402
    make_steps,
    messages,
    rss_bytes,
    start_server,
    stream_pairs,
)

from avest_client import EstimatorClient  # noqa: E402
from tests.support.serve import stop_process  # noqa: E402

B = 64


def feed(address: str, k: int, pairs: int, steps_each: int) -> list[str]:
    steps = make_steps(steps_each, B, k, seed=7)
    with EstimatorClient(address, timeout=60) as client:
        ids = [
            client.register("scrape/target", f"scrape/draft-{i}", "bench", k).pair_id
            for i in range(pairs)
        ]
    stream_pairs(address, [messages(pid, f"w-{i}", steps) for i, pid in enumerate(ids)])
    return ids


SCRAPER = """
import sys, time, httpx
with httpx.Client(timeout=120) as h:
    while True:
        t = time.perf_counter()
        r = h.get(sys.argv[1])
        print(f"{(time.perf_counter() - t) * 1e3:.3f} {len(r.content)}", flush=True)
"""


def timed_calls(client: EstimatorClient, ids: list[str], calls: int) -> np.ndarray:
    out = []
    for i in range(calls):
        t = time.perf_counter()
        client.coefficients(ids[(i * 7919) % len(ids)])
        out.append(time.perf_counter() - t)
    return np.array(out) * 1e3


def scrape_table(pairs: int, calls: int, tree: Path | None = None) -> dict:
    tmp = tempfile.mkdtemp(prefix="avest-bench-scrape-")
    proc, address, http = start(tmp, tree)
    try:
        ids = feed(address, 8, pairs, steps_each=5)
        time.sleep(1.0)
        durations: list[float] = []
        sizes: list[int] = []
        with EstimatorClient(address, timeout=60) as client:
            timed_calls(client, ids, 200)  # warm up
            idle = timed_calls(client, ids, calls)
            # The scraper runs in a process of its own: its reads must not take
            # the timed client's GIL.
            scraper = subprocess.Popen(
                [sys.executable, "-c", SCRAPER, f"{http}/metrics"],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert scraper.stdout is not None
            first = scraper.stdout.readline()  # one scrape done: the loop is running
            cpu0 = cpu_seconds(proc.pid)
            during = timed_calls(client, ids, calls)
            cpu = cpu_seconds(proc.pid) - cpu0
            scraper.terminate()
            rest, _ = scraper.communicate(timeout=60)
            for line in (first + rest).splitlines():
                ms, size = line.split()
                durations.append(float(ms) / 1e3)
                sizes.append(int(size))
    finally:
        stop_process(proc, 60)
    p = {
        name: (float(np.percentile(a, 50)), float(np.percentile(a, 99)))
        for name, a in (("idle", idle), ("during scrape", during))
    }
    return {
        "pairs": pairs,
        "server_cpu_ms_per_scrape": cpu / max(len(durations) - 1, 1) * 1e3,
        "get_coefficients_ms": p,
        "p99_ratio": p["during scrape"][1] / p["idle"][1],
        "scrape_ms": float(np.median(durations) * 1e3),
        "scrapes": len(durations),
        "scrape_bytes": int(np.median(sizes)),
    }


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process has used (user + system, all threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory(k: int, pairs: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="avest-bench-mem-")
    proc, address, _ = start(tmp)
    try:
        with EstimatorClient(address, timeout=30):
            time.sleep(0.5)
        before = rss_bytes(proc.pid)
        feed(address, k, pairs, steps_each=5)
        time.sleep(1.0)
        after = rss_bytes(proc.pid)
    finally:
        stop_process(proc, 60)
    db = sqlite3.connect(Path(tmp) / "avest.sqlite3")
    blob = db.execute("SELECT avg(length(arrays)) FROM snapshots").fetchone()[0]
    return {
        "k": k,
        "rss_bytes_per_pair": (after - before) / pairs,
        "held_bytes_per_pair": held_bytes(k, pairs),
        "snapshot_bytes": blob,
    }


def held_bytes(k: int, pairs: int, steps_each: int = 5) -> float:
    """Bytes the registry holds per pair (tracemalloc, in this process): five steps
    each, as the server's pairs get, and one snapshot record written and dropped."""
    import tracemalloc

    from avest.core.estimator import make_batch
    from avest.state.pairs import Registry, RuleConfig
    from avest_wire.pair import PairKey

    steps = [make_batch(x, d, a, k) for x, d, a in make_steps(steps_each, B, k, seed=7)]
    registry = Registry(RuleConfig(), max_pairs=pairs + 1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(pairs):
        pair, _ = registry.register(PairKey.of("mem/target", f"mem/draft-{i}", "bench", k))
        for seq, batch in enumerate(steps, start=1):
            pair.observe("w", seq, batch)
        registry.snapshot(pair)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / pairs


def start(data_dir: str, tree: Path | None = None) -> tuple:
    """``avest serve`` from this tree, or from ``tree`` (its ``service`` and ``wire``
    first on the server's path)."""
    saved = os.environ.get("PYTHONPATH")
    if tree is not None:
        paths = [str(tree / "service"), str(tree / "client"), str(tree / "wire")]
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, saved or ""])
    try:
        proc, address = start_server(data_dir)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved
    return proc, address, proc.avest_http  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--memory-pairs", type=int, default=200)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--baseline", type=Path, help="also time a server from this source tree (after ours)"
    )
    args = parser.parse_args()
    scrape = scrape_table(args.pairs, args.calls)
    if args.baseline:
        scrape["baseline"] = scrape_table(args.pairs, args.calls, args.baseline)
    scrape["load"] = os.getloadavg()[0]
    mem = [] if args.no_memory else [memory(k, args.memory_pairs) for k in (8, 64)]
    if args.json:
        print(json.dumps({"scrape": scrape, "memory": mem, "cpus": os.cpu_count()}, indent=2))
        return
    print(f"GetCoefficients during /metrics scrapes, {scrape['pairs']} pairs (K=8)")
    print(f"{'':<16} {'p50 ms':>8} {'p99 ms':>8}")
    for label, sc in (("this tree", scrape), ("baseline", scrape.get("baseline"))):
        if sc is None:
            continue
        print(f"-- {label}")
        for name, (p50, p99) in sc["get_coefficients_ms"].items():
            print(f"{name:<16} {p50:>8.3f} {p99:>8.3f}")
        print(f"p99 during / idle: {sc['p99_ratio']:.2f} (target <= 2)")
        print(
            f"scrape: median {sc['scrape_ms']:.0f} ms, {sc['scrape_bytes'] / 1e6:.1f} MB, "
            f"{sc['scrapes']} scrapes, server CPU {sc['server_cpu_ms_per_scrape']:.0f} ms "
            "per scrape (GetCoefficients calls included)"
        )
    print(f"load average at the end: {scrape['load']:.1f}")
    print(f"\nmemory per pair ({args.memory_pairs} pairs, 5 steps of B={B} each)")
    for m in mem:
        print(
            f"K={m['k']:<3} RSS {m['rss_bytes_per_pair'] / 1024:8.1f} KiB   "
            f"held {m['held_bytes_per_pair'] / 1024:8.1f} KiB   "
            f"snapshot {m['snapshot_bytes'] / 1024:8.1f} KiB"
        )


if __name__ == "__main__":
    main()
