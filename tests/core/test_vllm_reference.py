"""The core's ``vllm`` rule and feature against vLLM 0.33's estimator, step by step.

The reference is the CPU transcription of vLLM's ``OnlineAcceptanceEstimator``
(float32 like its kernels) that the shim's tests also drive; its source
contract is checked against vLLM's own code in ``tests/shim``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from avest.core.estimator import OnlineEstimator  # noqa: E402
from avest.core.features import logit_qmax_from_logits  # noqa: E402
from avest.core.rules import VllmRule  # noqa: E402
from tests.support.standin import StandinAcceptanceEstimator  # noqa: E402


@pytest.mark.parametrize("name", ["chat", "code"])
def test_vllm_rule_tracks_vllms_estimator_through_every_refit(trace_slice, name):
    trace = trace_slice(name)
    k = trace.k
    ref = StandinAcceptanceEstimator(64, k, torch.device("cpu"))
    ref.REFIT_INTERVAL = 25  # more refits to compare than vLLM's 100 on these short traces
    core = OnlineEstimator(k, VllmRule(), refit_interval=ref.REFIT_INTERVAL)
    starts = np.concatenate(([0], np.flatnonzero(np.diff(trace.step)) + 1, [trace.rows]))
    compared = 0
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        x = trace.features[lo:hi]
        d = trace.num_verified[lo:hi].astype(np.int64)
        a = trace.num_accepted[lo:hi].astype(np.int64)
        idx = torch.arange(hi - lo)
        ref.load_features(idx, torch.from_numpy(np.array(x)))
        # vLLM reports accepted + 1 bonus token, and the rejected drafts.
        ref.step(idx, torch.from_numpy(a + 1), torch.from_numpy(d - a))
        refit = core.observe(x, d, a)
        if refit is not None:
            compared += 1
            assert ref._refits == core.round
            np.testing.assert_allclose(ref.slope.item(), core.coefficients.slope, rtol=2e-4)
            np.testing.assert_allclose(
                ref.intercepts.numpy(), core.coefficients.intercept_array(), rtol=2e-4, atol=2e-4
            )
    assert compared == len(starts[:-1]) // ref.REFIT_INTERVAL >= 15


def test_feature_matches_vllms_kernel_math():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, size=(64, 1000)).astype(np.float32)
    logits[0, :] = 0.0
    logits[0, 7] = 20.0
    temperature = rng.choice([0.0, 0.7, 1.0, 1.3], size=64)
    ref = StandinAcceptanceEstimator(64, 1, torch.device("cpu"))
    conf = torch.zeros(64, 1)
    ref.predict(
        torch.from_numpy(logits),
        torch.arange(64),
        torch.tensor(0),
        conf,
        torch.from_numpy(temperature.astype(np.float32)),
    )
    ours = logit_qmax_from_logits(logits.astype(np.float64), temperature)
    np.testing.assert_allclose(ref.features[:, 0].numpy(), ours, rtol=1e-4, atol=1e-4)
