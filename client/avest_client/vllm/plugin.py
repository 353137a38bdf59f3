"""vLLM general plugin ``avest`` (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (API server, engine
core, workers), possibly more than once. With ``AVEST_ADDRESS`` unset it does
nothing. With it set, it arranges that when a worker imports vLLM's
speculator module, the ``OnlineAcceptanceEstimator`` name there is replaced by
the avest subclass (the speculator builds its estimator through that name in
``load_model``). It also records per-request exclusion flags
(``Sampler.add_request``) and the profiled cost curves
(``AdaptiveVerificationManager.set_cost_curves``), and hooks vLLM's worker
(``Worker.load_model``, ``Worker.shutdown``) and engine core
(``EngineCore.shutdown``): a worker that builds no estimator says so once, and
the shim's last round is sent when the engine shuts down
(:mod:`avest_client.vllm.lifecycle`). Where the front end builds the speculative
config (``EngineArgs.create_speculative_config``) it sets the pair's draft length by
batch size when the operator opts in (:mod:`avest_client.vllm.schedule`). If vLLM is absent or does not match
:mod:`avest_client.vllm.contract`, it logs and leaves vLLM untouched.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from avest_client.vllm import contract
from avest_client.vllm.config import ConfigError, ShimConfig

logger = logging.getLogger(__name__)

#: True once :func:`register` has armed the hooks in this process (or the parent it
#: was forked from: vLLM forks its engine core and workers after loading plugins).
ACTIVE = False


def register() -> None:
    global ACTIVE
    try:
        config = ShimConfig.from_env()
    except ConfigError as exc:
        logger.error("avest: bad configuration, plugin inactive: %s", exc)
        return
    if not config.enabled:
        return
    try:
        import vllm  # noqa: F401  - only to know it is there; submodules load lazily
    except ImportError:
        logger.warning("avest: AVEST_ADDRESS is set but vLLM is not installed; nothing to patch")
        return
    from avest_client.vllm.hooks import when_imported

    if config.strata:  # the sampler hook records each admitted slot's stratum from now
        from avest_client.vllm.strata import REGISTRY as STRATA

        STRATA.configure(config.strata_edges, config.strata_label)
        STRATA.enabled = True
    from avest_client.vllm.lifecycle import install_engine_hooks, install_worker_hooks

    when_imported(contract.SPECULATOR_MODULE, lambda m: patch_speculator(m, config))
    when_imported(contract.SAMPLER_MODULE, _hook_sampler)
    when_imported(contract.ADAPTIVE_VERIFICATION_MODULE, _hook_costs)
    when_imported(contract.WORKER_MODULE, install_worker_hooks)
    when_imported(contract.ENGINE_CORE_MODULE, install_engine_hooks)
    when_imported(contract.ARG_UTILS_MODULE, lambda m: _hook_schedule(m, config))
    ACTIVE = True
    logger.info("avest: plugin active in process %d (sidecar %s, %s mode%s)",
                os.getpid(), config.address, config.mode,
                ", strata" if config.strata else "")  # fmt: skip


def make_production_sink(config: ShimConfig, pair_key: Any) -> Any:
    """The network sink, imported only when a rank-0 estimator is built."""
    from avest_client.vllm.sidecar import sink as sidecar_sink

    return sidecar_sink.make_sink(config, pair_key)


def patch_speculator(module: ModuleType, config: ShimConfig) -> bool:
    """Replace ``module.OnlineAcceptanceEstimator`` with the avest subclass; idempotent."""
    base = getattr(module, contract.ESTIMATOR_CLASS, None)
    if getattr(base, "__avest_shim__", False):
        return True
    from avest_client.vllm.contract_check import check_live_class

    errors = check_live_class(base)
    if errors:
        logger.error("avest: vLLM's estimator does not match the contract, not patched: %s", errors)
        return False
    from avest_client.vllm.estimator import make_sidecar_estimator
    from avest_client.vllm.exclusion import REGISTRY
    from avest_client.vllm.pair import current_pair
    from avest_client.vllm.tp import vllm_tp_group

    shim = make_sidecar_estimator(
        base,  # type: ignore[arg-type]
        make_production_sink,
        config=config,
        pair_resolver=lambda k: current_pair(k, config.labels),
        group_resolver=vllm_tp_group,
        exclusion=REGISTRY,
    )
    setattr(module, contract.ESTIMATOR_CLASS, shim)
    logger.info("avest: %s.%s -> %s", module.__name__, contract.ESTIMATOR_CLASS, shim.__name__)
    return True


def _hook_sampler(module: ModuleType) -> None:
    from avest_client.vllm.exclusion import install_sampler_hook

    cls = getattr(module, "Sampler", None)
    if cls is not None:
        install_sampler_hook(cls)


def _hook_costs(module: ModuleType) -> None:
    from avest_client.vllm.costs import install_cost_curve_hook

    cls = getattr(module, "AdaptiveVerificationManager", None)
    if cls is not None:
        install_cost_curve_hook(cls)


def _hook_schedule(module: ModuleType, config: ShimConfig) -> None:
    from avest_client.vllm.schedule import install

    install(module, config)
