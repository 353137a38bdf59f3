"""Core throughput: drafts folded per second, refit time (a report, not a test).

    python bench/bench_core.py

Folding one step = validating it, computing the linear predictor, adding its
round statistics and its calibration state (``OnlineEstimator.observe``
without the refit). Targets: >= 10 M drafts/s at B = 256, K = 8; a refit
under 100 us.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from avest.core.estimator import OnlineEstimator, make_batch
from avest.core.metrics import CalibrationState
from avest.core.model import Coefficients, linear_predictor
from avest.core.rules import RecursiveRule, VllmRule
from avest.core.stats import fold


def timeit(fn, repeat: int = 7, number: int = 200) -> float:
    """Median seconds per call over ``repeat`` runs of ``number`` calls."""
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - t0) / number)
    return statistics.median(runs)


def batch(rows: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(1.0, 2.0, size=(rows, k)).astype(np.float32)
    return x, np.full(rows, k, dtype=np.int32), rng.integers(0, k + 1, size=rows).astype(np.int32)


def main() -> None:
    print("fold: drafts per second (B requests x K positions per step)")
    print(
        f"{'B':>5} {'K':>3} {'observe us':>11} {'M drafts/s':>11} {'stats+calib only us':>20} {'M drafts/s':>11}"
    )
    for rows in (64, 256):
        for k in (5, 8, 16):
            x, d, a = batch(rows, k)
            est = OnlineEstimator(k, refit_interval=10**9)
            t_obs = timeit(lambda est=est, x=x, d=d, a=a: est.observe(x, d, a))
            b = make_batch(x, d, a, k)
            coef = Coefficients.cold_start(k)
            calib = CalibrationState.empty(k)

            def fold_only(b=b, coef=coef, calib=calib) -> None:
                eta = linear_predictor(coef, b.features)
                fold(b.features, eta, b.observed, b.accepted)
                calib.update(eta, b.observed, b.accepted)

            t_fold = timeit(fold_only)
            n = rows * k
            print(
                f"{rows:>5} {k:>3} {t_obs * 1e6:>11.1f} {n / t_obs / 1e6:>11.2f} {t_fold * 1e6:>20.1f} {n / t_fold / 1e6:>11.2f}"
            )

    print("\nrefit: one update-rule step on a round's statistics")
    for k in (5, 8, 16, 64):
        x, d, a = batch(256, k)
        est = OnlineEstimator(k, refit_interval=10**9)
        est.observe(x, d, a)
        stats = est.round_stats
        for name, rule in (("vllm", VllmRule()), ("recursive", RecursiveRule())):
            rule.reset(est.coefficients)
            t = timeit(
                lambda rule=rule, est=est, stats=stats: rule.refit(est.coefficients, stats),
                number=2000,
            )
            print(f"  K={k:<3} {name:<10} {t * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
