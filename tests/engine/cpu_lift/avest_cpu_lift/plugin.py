"""vLLM general plugin ``avest_cpu_lift`` (test only): adaptive verification on a CPU.

With ``AVEST_CPU_LIFT=1``, in every vLLM process it lifts the four checks that
refuse AV on the CPU platform, each where vLLM makes it (on a GPU leave it
unset: nothing is lifted there, and the two settings below work alone):

1. ``VllmConfig._validate_adaptive_verification`` requires full CUDA graphs; the
   CPU platform forces cudagraph mode NONE. The other checks still run.
2. ``maybe_create_adaptive_verification_manager`` refuses backends that cannot
   replay varlen decode graphs; nothing is graph-replayed on a CPU and CPU
   attention plans from the trimmed query lengths.
3. ``resolve_adaptive_cudagraph_mode`` asserts full CUDA graphs: mode NONE is
   kept as it is.
4. Cost curves are profiled only in ``capture_model``, which the CPU worker
   never calls: fixed curves are set right after the manager is built
   (``AVEST_CPU_LIFT_COSTS``, see ``_cost_curves``).

``AVEST_CPU_LIFT_REFIT_INTERVAL=N`` sets ``OnlineAcceptanceEstimator.REFIT_INTERVAL``
(vLLM's 100 steps is more than a short CPU run takes).

With ``AVEST_CPU_LIFT_RECORD=DIR`` it also keeps the test's own record of what
vLLM graded, taken inside vLLM's ``OnlineAcceptanceEstimator.step`` (whatever
subclass runs it): per position, the labelled drafts, the accepted ones and the
sum of the predictions they were graded at, plus the coefficients in force after
each step. It is written to ``DIR/graded-<pid>.json`` after every step. And, in the
process that runs vLLM's scheduler, each step's batch size and the draft length it
scheduled for it (``Scheduler.schedule``'s ``num_spec_tokens_to_schedule``) to
``DIR/scheduled-<pid>.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys

logger = logging.getLogger(__name__)

_ADAPTIVE = "vllm.v1.worker.gpu.spec_decode.adaptive_verification"
_RUNNER = "vllm.v1.worker.gpu.model_runner"
_ESTIMATOR = "vllm.v1.worker.gpu.spec_decode.acceptance_estimator"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_done: set[str] = set()


def register() -> None:
    from avest_client.vllm.hooks import when_imported  # reuse avest's post-import hook

    if os.environ.get("AVEST_CPU_LIFT") == "1":
        when_imported("vllm.config.vllm", _lift_config)
        when_imported(_ADAPTIVE, _lift_varlen_check)
        when_imported(_RUNNER, _lift_runner)
    if os.environ.get("AVEST_CPU_LIFT_REFIT_INTERVAL"):
        when_imported(_ESTIMATOR, _set_refit_interval)
    if os.environ.get("AVEST_CPU_LIFT_RECORD"):
        when_imported(_ESTIMATOR, _record_graded)
        when_imported(_SCHEDULER, _record_scheduled)
        import multiprocessing.util

        multiprocessing.util.Finalize(None, _write_process, exitpriority=1)
        os.register_at_fork(after_in_child=_write_process)
        when_imported("vllm.v1.engine.core", _write_process_after_engine_core_init)


def _write_process_after_engine_core_init(module) -> None:  # noqa: ANN001
    """The engine core's process (spawned, and killed by vLLM at shutdown) is recorded as its
    busy loop starts: by then it has loaded every plugin."""
    if not _once("engine core"):
        return
    cls = module.EngineCoreProc
    run_busy_loop = cls.run_busy_loop

    def record_then_run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        _write_process()
        return run_busy_loop(self, *args, **kwargs)

    cls.run_busy_loop = record_then_run


def _write_process() -> None:
    """``DIR/process-<pid>.json``: whether avest's plugin is armed in this process and which
    estimator class its speculator builds, if it has imported one. Written in each forked
    child as it starts (vLLM forks its workers after loading plugins, so a child inherits
    the parent's hooks), in the engine core's process as its busy loop starts (vLLM kills
    that process at shutdown), and in every process at exit."""
    plugin = sys.modules.get("avest_client.vllm.plugin")
    speculator = sys.modules.get("vllm.v1.worker.gpu.spec_decode.speculator")
    cls = getattr(speculator, "OnlineAcceptanceEstimator", None)
    info = {
        "pid": os.getpid(),
        "name": __import__("multiprocessing").current_process().name,
        "avest_active": bool(getattr(plugin, "ACTIVE", False)),
        "speculator_estimator": None if cls is None else cls.__name__,
    }
    path = os.path.join(os.environ["AVEST_CPU_LIFT_RECORD"], f"process-{os.getpid()}.json")
    with open(path, "w") as f:
        json.dump(info, f)


def _once(name: str) -> bool:
    if name in _done:
        return False
    _done.add(name)
    return True


def _lift_config(module) -> None:  # noqa: ANN001
    if not _once("config"):
        return
    cls = module.VllmConfig
    original = cls._validate_adaptive_verification

    def validate_without_cuda_graphs(self) -> None:  # noqa: ANN001
        mode_cls = type(self.compilation_config.cudagraph_mode)
        has_full = mode_cls.has_full_cudagraphs
        mode_cls.has_full_cudagraphs = lambda mode: True
        try:
            original(self)
        finally:
            mode_cls.has_full_cudagraphs = has_full

    cls._validate_adaptive_verification = validate_without_cuda_graphs


def _lift_varlen_check(module) -> None:  # noqa: ANN001
    if _once("varlen"):
        module.get_varlen_cudagraph_unsupported_backend = lambda *a, **k: None


def _cost_curves(max_reqs: int, max_tokens: int) -> tuple[list, list]:
    """Cost lines with a point at every size (vLLM's tables pad a size up to the next
    profiled point, as CUDA graphs do, so two points alone would price every size above 1
    at the largest). ``AVEST_CPU_LIFT_COSTS``: ``D0,D1,V0,V1`` for draft(r) = D0 + D1·r and
    verify(t) = V0 + V1·t ms (default ``1,0.5,2,1``: a fixed cost per step, as on a GPU,
    so AV admits a request's likelier drafts and trims the rest, the more the larger the
    batch), or ``D:V`` for lines through the origin."""
    spec = os.environ.get("AVEST_CPU_LIFT_COSTS", "1,0.5,2,1")
    if ":" in spec:
        d1, v1 = (float(x) for x in spec.split(":"))
        d0 = v0 = 0.0
    else:
        d0, d1, v0, v1 = (float(x) for x in spec.split(","))
    draft = [(r, d0 + d1 * r) for r in range(1, max(2, max_reqs) + 1)]
    verify = [(t, v0 + v1 * t) for t in range(1, max(2, max_tokens) + 1)]
    return draft, verify


def _lift_runner(module) -> None:  # noqa: ANN001
    if not _once("runner"):
        return
    create = module.maybe_create_adaptive_verification_manager
    resolve = module.resolve_adaptive_cudagraph_mode

    def create_with_fixed_costs(**kwargs):  # noqa: ANN003, ANN202
        kwargs["additional_attn_cg_support"] = None
        manager = create(**kwargs)
        if manager is not None:
            rs = kwargs["req_states"]
            draft, verify = _cost_curves(rs.max_num_reqs, rs.max_num_batched_tokens)
            manager.set_cost_curves(draft, verify)
        return manager

    def keep_mode_none(mode, *, piecewise_capture_available):  # noqa: ANN001, ANN202
        if not mode.has_full_cudagraphs():
            return mode
        return resolve(mode, piecewise_capture_available=piecewise_capture_available)

    module.maybe_create_adaptive_verification_manager = create_with_fixed_costs
    module.resolve_adaptive_cudagraph_mode = keep_mode_none


def _set_refit_interval(module) -> None:  # noqa: ANN001
    module.OnlineAcceptanceEstimator.REFIT_INTERVAL = int(
        os.environ["AVEST_CPU_LIFT_REFIT_INTERVAL"]
    )


def _record_graded(module) -> None:  # noqa: ANN001
    if not _once("record"):
        return
    cls = module.OnlineAcceptanceEstimator
    original = cls.step
    out = os.path.join(os.environ["AVEST_CPU_LIFT_RECORD"], f"graded-{os.getpid()}.json")
    rec: dict = {}

    def step(self, idx_mapping, num_sampled, num_rejected):  # noqa: ANN001, ANN202
        k = int(self.num_speculative_steps)
        if not rec:
            rec.update(
                pid=os.getpid(), argv=sys.argv[:1], estimator=type(self).__name__,
                mro=[f"{c.__module__}.{c.__qualname__}" for c in type(self).__mro__],
                k=k, steps=0, counts=[0] * k, accepted=[0] * k, pred_sum=[0.0] * k,
                coefficients=[],
            )  # fmt: skip
        acc = (num_sampled.long() - 1).clamp(min=0).cpu()
        admitted = acc + num_rejected.long().cpu()
        pred = self.predictions[idx_mapping.long()].cpu()
        for pos in range(k):
            observed = (pos <= acc) & (pos < admitted)
            rec["counts"][pos] += int(observed.sum())
            rec["accepted"][pos] += int((observed & (pos < acc)).sum())
            rec["pred_sum"][pos] += float(pred[:, pos][observed].double().sum())
        rec["steps"] += 1
        rec.setdefault("per_step", []).append(
            [int(((pos <= acc) & (pos < admitted)).sum()) for pos in range(k)]
        )
        # verified fewer than K drafts, but some, and rejected none: trimmed by AV (or at the
        # request's end; a row that verified none is a prefill)
        short = (admitted > 0) & (admitted < k) & (acc == admitted)
        rec["short_rows"] = rec.get("short_rows", 0) + int(short.sum())
        original(self, idx_mapping, num_sampled, num_rejected)
        stats = self.avest_stats() if hasattr(self, "avest_stats") else {}
        rec["coefficients"].append(
            {
                "refits": int(self._refits),
                "slope": float(self.slope[0]),
                "intercepts": [float(v) for v in self.intercepts],
                "avest_version": stats.get("version"),
                "governed": stats.get("governed"),
            }
        )
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f)
        os.replace(tmp, out)

    cls.step = step


def _record_scheduled(module) -> None:  # noqa: ANN001
    """``[batch size, draft length]`` per step that schedules anything (vLLM picks the
    draft length from the batch size when a schedule is configured)."""
    if not _once("scheduled"):
        return
    cls = module.Scheduler
    original = cls.schedule
    out = os.path.join(os.environ["AVEST_CPU_LIFT_RECORD"], f"scheduled-{os.getpid()}.json")
    steps: list[list[int]] = []

    def schedule(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        output = original(self, *args, **kwargs)
        batch = len(output.num_scheduled_tokens)
        if batch:
            steps.append([batch, int(output.num_spec_tokens_to_schedule)])
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(steps, f)
            os.replace(tmp, out)
        return output

    cls.schedule = schedule
