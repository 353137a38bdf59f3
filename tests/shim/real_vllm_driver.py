"""Drive vLLM 0.33's real speculator and estimator, with the avest plugin, on a CPU.

Run by ``test_real_vllm.py`` in ``.venv-vllm`` (``scripts/vllm-env``), never
imported by the main suite. Environment: ``TRITON_INTERPRET=1`` and
``CUDA_VISIBLE_DEVICES=`` (vLLM's Triton kernels run in Triton's interpreter),
``VLLM_PLUGINS=avest`` and the plugin's ``AVEST_*`` settings.

    python real_vllm_driver.py OUT_DIR STEPS REQUESTS K REFIT_INTERVAL

What is vLLM's own: the plugin loader (``load_general_plugins``, which finds
avest through its entry point), the speculator module the plugin patches,
``DraftModelSpeculator.load_model`` (run under ``set_current_vllm_config``),
``_maybe_predict_acceptance`` (one call per draft position, as ``propose``
makes it, with the real predict kernel computing the features from logits),
``observe_verification`` (the real step: accumulate and refit kernels) and
the estimator class itself. What is not: the speculator's constructor, which
resolves the target's Hugging Face architecture, is replaced by setting the
attributes it sets; the draft model is a stub (load_model only stores it);
the logits are random; verdicts are drawn from the estimator's own
predictions, with a random verification depth per request.

After each step's ``predict`` calls it compares the confidences vLLM's
adaptive verification reads (``draft_token_confidence_probs``) with what
the shim's calibration table in force makes of vLLM's linear confidences
``sigmoid(slope x + b_k)``: the table's piecewise-linear map of the linear
predictor while the table is served, the linear confidences otherwise. The
table's own ops inside ``predict`` are logged by a torch dispatch mode:
host synchronisations (``.item()``-like reads, data-dependent shapes) and
how many distinct op and shape sequences each batch size gives.

Writes ``OUT_DIR/steps.npz`` (each step's rows as the shim forwarded them)
and ``OUT_DIR/result.json`` (what the checks below saw), and exits non-zero
on the first failed check.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

TARGET = "avest-ci/target"
DRAFT = "avest-ci/draft"
VOCAB = 64


#: Ops that read a device value on the host or give a shape that depends on data.
HOST_SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "item")


class OpLog(TorchDispatchMode):
    """Every aten op run inside, with the shapes of what it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = tuple(tuple(o.shape) for o in outs if isinstance(o, torch.Tensor))
        self.ops.append((str(func), shapes))
        return out


def log_table_ops(table_map) -> tuple[dict[int, set], list[int]]:  # noqa: ANN001
    """Wrap the shim's table ``apply`` (run inside vLLM's predict) in an :class:`OpLog`;
    the op sequences seen, by number of tokens, and the number of calls."""
    seen: dict[int, set] = {}
    calls = [0]
    apply = table_map.apply

    def logged(est, num_tokens, *args):  # noqa: ANN001, ANN002, ANN202
        with OpLog() as log:
            apply(est, num_tokens, *args)
        seen.setdefault(int(num_tokens), set()).add(tuple(log.ops))
        calls[0] += 1

    table_map.apply = logged
    return seen, calls


def table_check(est, idx: torch.Tensor, conf: torch.Tensor) -> dict:  # noqa: ANN001
    """The step's confidences against the table in force applied to vLLM's linear ones."""
    m = est._avest.tables.map
    x = est.features[idx]
    eta = est.slope[0] * x + est.intercepts  # float32, as vLLM's predict kernel
    linear = torch.sigmoid(eta).double().numpy()
    served = bool(m.served.item() > 0.5)
    want = linear
    if served:
        knots, logits, _ = m.table
        want = 1.0 / (1.0 + np.exp(-np.interp(eta.double().numpy(), knots, logits)))
    got = conf.double().numpy()
    return {
        "served": served,
        "err": float(np.abs(got - want).max()),
        "bend": float(np.abs(got - linear).max()),
        "table": None if m.table is None else [list(m.table[0]), list(m.table[1]), m.table[2]],
    }


def check(cond: bool, what: str) -> None:
    if not cond:
        raise SystemExit(f"check failed: {what}")


def main() -> int:
    out = Path(sys.argv[1])
    steps, reqs, k, refit_interval = (int(a) for a in sys.argv[2:6])
    check(os.environ.get("TRITON_INTERPRET") == "1", "TRITON_INTERPRET=1")
    check(os.environ.get("CUDA_VISIBLE_DEVICES") == "", "CUDA_VISIBLE_DEVICES empty")
    check(os.environ.get("VLLM_PLUGINS") == "avest", "VLLM_PLUGINS=avest")
    t0 = time.monotonic()

    # vLLM's worker: plugins first, then the speculator module (the plugin's
    # post-import hook patches it as it loads).
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode import acceptance_estimator as real
    from vllm.v1.worker.gpu.spec_decode import speculator as S

    shim = S.OnlineAcceptanceEstimator
    check(getattr(shim, "__avest_shim__", False), "the plugin patched the speculator module")
    check(shim.__avest_base__ is real.OnlineAcceptanceEstimator, "the shim wraps vLLM's class")

    # Short rounds, so a few dozen steps cross several local refit points.
    class ShortRounds(shim):  # type: ignore[misc, valid-type]
        REFIT_INTERVAL = refit_interval

    S.OnlineAcceptanceEstimator = ShortRounds  # the name load_model builds through

    class StubDrafter(S.DraftModelSpeculator):
        def load_draft_model(self, target_model, target_attn_layer_names):  # noqa: ANN001
            return torch.nn.Linear(4, 4)

        def init_cudagraph_manager(self, cudagraph_mode):  # noqa: ANN001
            raise NotImplementedError

        def capture(self):
            raise NotImplementedError

        def propose(self, *args, **kwargs):  # noqa: ANN002, ANN003
            raise NotImplementedError

    spec_cfg = SimpleNamespace(
        model=DRAFT,
        method="draft_model",
        draft_sample_method="probabilistic",
        num_speculative_tokens=k,
        enable_adaptive_verification=True,
        use_local_argmax_reduction=False,
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=TARGET, supports_multimodal_inputs=False),
        speculative_config=spec_cfg,
        compilation_config=SimpleNamespace(static_forward_context={}),
    )
    cpu = torch.device("cpu")
    spec = object.__new__(StubDrafter)
    spec.__dict__.update(
        vllm_config=vllm_config,
        speculative_config=spec_cfg,
        method="draft_model",
        device=cpu,
        max_num_reqs=reqs,
        num_speculative_steps=k,
        enable_adaptive_verification=True,
        use_acceptance_estimator=True,
        use_local_argmax_reduction=False,
        acceptance_estimator=None,
        temperature=torch.ones(reqs, dtype=torch.float32),
        draft_token_confidence_probs=torch.zeros(reqs, k, dtype=torch.float32),
    )
    with set_current_vllm_config(vllm_config):
        spec.load_model(torch.nn.Identity())
    est = spec.acceptance_estimator
    check(type(est) is ShortRounds, f"load_model built {type(est).__name__}")
    check(isinstance(est, real.OnlineAcceptanceEstimator), "a real OnlineAcceptanceEstimator")
    rt = est._avest
    check(rt is not None and rt.sink is not None, "the shim has its sidecar sink")
    sink = rt.sink
    check(sink.wait_connected(30), f"sidecar connected ({sink.stats})")
    mode = getattr(rt, "mode", "raw")
    ptrs = (est.slope.data_ptr(), est.intercepts.data_ptr())
    table_ops, table_calls = log_table_ops(rt.tables.map)
    table_checks: list[dict] = []
    t_ready = time.monotonic()

    strata_on = os.environ.get("AVEST_STRATA") == "1"
    if strata_on:
        # A mixed batch: what vLLM's Sampler.add_request (the hook the plugin wraps)
        # records as each request is admitted, half greedy and half at T = 0.8.
        from avest_client.vllm import strata as strata_mod

        check(rt.strata is not None, "strata built (AVEST_STRATA=1)")
        for slot in range(reqs):
            t = 0.0 if slot % 2 == 0 else 0.8
            strata_mod.REGISTRY.record(slot, SimpleNamespace(temperature=t))

    rng = np.random.default_rng(11)
    gen = torch.Generator().manual_seed(11)
    rows: dict[str, list[np.ndarray]] = {
        n: [] for n in ("features", "num_verified", "num_accepted", "step", "request")
    }
    applied: list[tuple[int | None, float, list[float], bool]] = []
    for n in range(steps):
        # propose(): a varying subset of the slots, in a varying order
        live = rng.permutation(reqs)[: int(rng.integers(reqs // 2, reqs + 1))]
        idx = torch.as_tensor(live, dtype=torch.int64)
        for pos in range(k):
            logits = torch.randn(len(live), VOCAB, generator=gen) * float(rng.uniform(1, 6))
            spec._maybe_predict_acceptance(logits, idx, torch.tensor(pos, dtype=torch.int64))
        if not strata_on:  # with strata served, confidences are each stratum's
            table_checks.append(
                table_check(est, idx, spec.draft_token_confidence_probs[: len(live)].clone())
            )
        # the target's verdicts, drawn from the predictions; a random verification depth
        p = est.predictions[idx].numpy()
        depth = rng.integers(1, k + 1, size=len(live))
        accepted_mask = rng.uniform(size=p.shape) < p
        run = np.cumprod(accepted_mask, axis=1).sum(axis=1)
        num_accepted = np.minimum(run, depth)
        num_rejected = np.where(num_accepted < depth, depth - num_accepted, 0)
        num_sampled = num_accepted + 1
        spec.observe_verification(
            idx,
            torch.as_tensor(num_sampled, dtype=torch.int32),
            torch.as_tensor(num_rejected, dtype=torch.int32),
        )
        rows["features"].append(est.features[idx].numpy().copy())
        rows["num_verified"].append((num_accepted + num_rejected).astype(np.int32))
        rows["num_accepted"].append(num_accepted.astype(np.int32))
        rows["step"].append(np.full(len(live), n, dtype=np.int64))
        rows["request"].append(live.astype(np.int64))
        st = est.avest_stats()
        same_storage = (est.slope.data_ptr(), est.intercepts.data_ptr()) == ptrs
        applied.append((st["version"], est.slope.item(), est.intercepts.tolist(), same_storage))
    t_steps = time.monotonic()

    check(rt.transfer is None or rt.transfer.flush(60), "forwarder flushed")
    check(sink.flush(60), f"sink flushed ({sink.stats})")
    # The refit the last steps caused reaches the tensors at the next step boundary.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        latest = sink.latest_coefficients()
        if latest is not None and latest.version == sink_pair_version(sink):
            break
        time.sleep(0.02)
    update = rt.governor.boundary()
    if update is not None:
        rt.apply(est, update)
    stats = est.avest_stats()
    np.savez(out / "steps.npz", **{n: np.concatenate(v) for n, v in rows.items()})
    if strata_on:  # the sets in force at the end, and every slot's last predictions
        assert rt.strata is not None
        stats["strata_in_force"] = [None if s is None else s[0] for s in rt.strata.in_force]
    result = {
        "mode": mode,
        "shim_class": type(est).__name__,
        "base_class": f"{shim.__avest_base__.__module__}.{shim.__avest_base__.__qualname__}",
        "pair_id": sink.pair_id,
        "stats": {k_: v for k_, v in stats.items() if k_ != "sink"},
        "sink": stats.get("sink"),
        "latest": _plain(sink.latest_coefficients()),
        "slope": est.slope.item(),
        "intercepts": est.intercepts.tolist(),
        "same_storage": (est.slope.data_ptr(), est.intercepts.data_ptr()) == ptrs,
        "applied_per_step": applied,
        "local_refits": est._refits,
        "refit_interval": est.REFIT_INTERVAL,
        "seconds": {"setup": t_ready - t0, "steps": t_steps - t_ready},
        "torch": torch.__version__,
        "table_checks": table_checks,
        "table_ops": {
            "calls": table_calls[0],
            "host_syncs": sorted(
                {
                    op
                    for seqs in table_ops.values()
                    for seq in seqs
                    for op, _ in seq
                    if any(name in op for name in HOST_SYNC_OPS)
                }
            ),  # fmt: skip
            "max_sequences_per_size": max((len(v) for v in table_ops.values()), default=0),
            "sizes": sorted(table_ops),
        },
    }
    (out / "result.json").write_text(json.dumps(result))
    est.avest_close()
    return 0


def _plain(latest) -> list | None:  # noqa: ANN001
    """The sink's latest coefficients as JSON: ``[version, slope, intercepts]``."""
    return None if latest is None else [latest.version, latest.slope, list(latest.intercepts)]


def sink_pair_version(sink) -> int | None:  # noqa: ANN001
    """The pair's current version on the sidecar (GetCoefficients)."""
    try:
        return int(sink._client.coefficients(sink.pair_id).version)
    except Exception:  # noqa: BLE001
        return None


if __name__ == "__main__":
    sys.exit(main())
