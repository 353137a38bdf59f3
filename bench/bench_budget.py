"""Time one budget decision per rule at R=256 requests, K=16 positions (target < 1 ms).

Costs imitate a vLLM profile: CUDA-graph buckets up to 512 tokens (steps of 8,
then 16), piecewise-linear beyond, so the tables have both staircase and
interpolated regions. Confidences are fresh random draws for every call, so no
rule benefits from repeated inputs; the lossless walk's cost-only extension
rates are cached per (T0, N), which repeats step to step in steady state, so
a call that misses that cache is reported separately ("cold", median of 20).

Usage: python bench/bench_budget.py [--repeats N] [--requests R] [--positions K]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from avest.core.budget import RULES, decide
from avest.core.costs import CostTable


def vllm_like_costs(max_requests: int, max_tokens: int) -> CostTable:
    captured = [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    verify = [(s, 5.0 + 0.004 * s + (0.4 if s > 256 else 0.0)) for s in captured]
    verify += [(768, 9.0), (1024, 11.0), (2048, 18.0), (4096, 33.0), (8192, 65.0)]
    draft = [(r, 1.0 + 0.01 * r) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)]
    return CostTable.from_curves(
        draft, verify, 512, max_requests=max_requests, max_tokens=max_tokens
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=500)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--positions", type=int, default=16)
    args = parser.parse_args()
    r, k = args.requests, args.positions
    rng = np.random.default_rng(0)
    scheduled = np.full(r, k)
    inputs = [
        (rng.beta(5, 2, size=(r, k)), rng.beta(5, 2, size=(r, k))) for _ in range(args.repeats)
    ]

    print(f"decide() at R={r}, K={k}: {args.repeats} calls per rule, fresh confidences each")
    print(
        f"{'rule':<14} {'lossless':<8} {'cold ms':>8} {'median ms':>10} {'p90 ms':>8} {'budget':>7}"
    )
    for name, rule in RULES.items():
        costs = vllm_like_costs(1024, 16384)
        decide(name, inputs[0][0], scheduled, costs, r, r, inputs[0][1])  # warm up
        colds = []
        for conf, stale in inputs[:20]:
            fresh = vllm_like_costs(1024, 16384)  # empty cache: a new step shape (T0, N)
            t = time.perf_counter()
            decide(name, conf, scheduled, fresh, r, r, stale)
            colds.append(time.perf_counter() - t)
        cold = statistics.median(colds)
        times, budgets = [], []
        for conf, stale in inputs:
            t = time.perf_counter()
            d = decide(name, conf, scheduled, costs, r, r, stale)
            times.append(time.perf_counter() - t)
            budgets.append(d.budget)
        times.sort()
        median = statistics.median(times)
        p90 = times[int(0.9 * (len(times) - 1))]
        print(
            f"{name:<14} {'yes' if rule.lossless else 'no':<8} {cold * 1e3:>8.3f} "
            f"{median * 1e3:>10.3f} {p90 * 1e3:>8.3f} {int(np.median(budgets)):>7}"
        )
    print("target: median < 1 ms")


if __name__ == "__main__":
    main()
