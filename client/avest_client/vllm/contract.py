"""Everything the shim relies on in vLLM 0.33, declared once.

This list is the single source for two checks:

* ``tests/shim/test_vllm_contract.py`` reads vLLM's *source* (installed package,
  wheel or folder) and verifies every entry by AST, without importing vLLM
  (:mod:`avest_client.vllm.contract_check`);
* at run time the plugin checks the live estimator class against the
  :data:`ESTIMATOR` entry before patching, and leaves vLLM untouched on a
  mismatch.

Paths are relative to the root that holds the ``vllm/`` package. Parameter
tuples list every parameter in order, ``self`` included; ``*name`` and
``**name`` mark variadic ones. Entries are plain data: nothing here imports
vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The vLLM release this contract was written against.
VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class Method:
    """A method (or property) defined in the class body with exactly these parameters."""

    name: str
    params: tuple[str, ...]


@dataclass(frozen=True)
class Class:
    """A class defined at module level in ``path``."""

    path: str
    name: str
    methods: tuple[Method, ...] = ()
    #: names assigned on ``self`` anywhere in ``__init__``
    init_attributes: tuple[str, ...] = ()
    #: names assigned (or annotated) in the class body: constants and config fields
    class_attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Function:
    """A module-level function with exactly these parameters."""

    path: str
    name: str
    params: tuple[str, ...]


@dataclass(frozen=True)
class ModuleName:
    """A module-level name; ``from_module`` set means bound by ``from from_module import name``."""

    path: str
    name: str
    from_module: str | None = None


@dataclass(frozen=True)
class Constant:
    """A module-level ``name = <literal>`` with this value."""

    path: str
    name: str
    value: object


@dataclass(frozen=True)
class Call:
    """Inside ``cls.method``, a call ``callee(args...)`` whose positional arguments unparse to ``args``."""

    path: str
    cls: str
    method: str
    callee: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class Statements:
    """Inside ``cls.method``, statements/expressions whose ``ast.unparse`` equals each string.

    Used where the shim depends on *how* a method works, not only on its name:
    the refit counter that the shim resets to skip a local refit. An empty
    ``cls`` names a module-level function.
    """

    path: str
    cls: str
    method: str
    snippets: tuple[str, ...] = field(default=())


Entry = Class | Function | ModuleName | Constant | Call | Statements

_SPEC = "vllm/v1/worker/gpu/spec_decode"
ESTIMATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.acceptance_estimator"
SPECULATOR_MODULE = "vllm.v1.worker.gpu.spec_decode.speculator"
SAMPLER_MODULE = "vllm.v1.worker.gpu.sample.sampler"
ADAPTIVE_VERIFICATION_MODULE = "vllm.v1.worker.gpu.spec_decode.adaptive_verification"
WORKER_MODULE = "vllm.v1.worker.gpu_worker"
ENGINE_CORE_MODULE = "vllm.v1.engine.core"
ARG_UTILS_MODULE = "vllm.engine.arg_utils"
ESTIMATOR_CLASS = "OnlineAcceptanceEstimator"

#: The class the shim subclasses; also checked at run time against the live class.
ESTIMATOR = Class(
    path=f"{_SPEC}/acceptance_estimator.py",
    name=ESTIMATOR_CLASS,
    methods=(
        Method("__init__", ("self", "max_num_reqs", "num_speculative_steps", "device")),
        Method("step", ("self", "idx_mapping", "num_sampled", "num_rejected")),
        Method(
            "predict",
            ("self", "logits", "idx_mapping", "draft_step", "confidence_probs", "temperature"),
        ),
    ),
    init_attributes=(
        "num_speculative_steps",
        "device",
        "_steps_since_refit",
        "_refits",
        "slope",
        "intercepts",
        "features",
        "predictions",
        "info",
        "grad",
        "counts",
    ),
    class_attributes=("REFIT_INTERVAL", "DAMPING_OBSERVATIONS", "L2"),
)

ENTRIES: tuple[Entry, ...] = (
    ESTIMATOR,
    # The shim skips a local refit by resetting this counter before the base
    # step runs; it relies on step() counting and comparing exactly like this.
    Statements(
        path=ESTIMATOR.path,
        cls=ESTIMATOR_CLASS,
        method="step",
        snippets=(
            "self._steps_since_refit += 1",
            "self._steps_since_refit < self.REFIT_INTERVAL",
            "self._steps_since_refit = 0",
            "self._refits += 1",
        ),
    ),
    # The speculator binds the class by name at import; the plugin patches this name.
    ModuleName(
        path=f"{_SPEC}/speculator.py",
        name=ESTIMATOR_CLASS,
        from_module=ESTIMATOR_MODULE,
    ),
    Class(
        path=f"{_SPEC}/speculator.py",
        name="DraftModelSpeculator",
        methods=(
            Method("load_model", ("self", "target_model")),
            Method("observe_verification", ("self", "idx_mapping", "num_sampled", "num_rejected")),
        ),
        init_attributes=("acceptance_estimator", "max_num_reqs", "num_speculative_steps"),
    ),
    # ... and builds it in load_model with exactly these three arguments.
    Call(
        path=f"{_SPEC}/speculator.py",
        cls="DraftModelSpeculator",
        method="load_model",
        callee=ESTIMATOR_CLASS,
        args=("self.max_num_reqs", "self.num_speculative_steps", "self.device"),
    ),
    Call(
        path=f"{_SPEC}/speculator.py",
        cls="DraftModelSpeculator",
        method="observe_verification",
        callee="self.acceptance_estimator.step",
        args=("idx_mapping", "num_sampled", "num_rejected"),
    ),
    # Summary mode holds each step's (idx_mapping, num_sampled, num_rejected) by
    # reference until the round's sketch is built: vLLM allocates all three afresh
    # every step (a round that sees shared storage falls back to copies anyway).
    Statements(
        path="vllm/v1/worker/gpu/model_runner.py",
        cls="GPUModelRunner",
        method="prepare_inputs",
        snippets=(
            "idx_mapping = async_tensor_h2d(idx_mapping_np, device=self.device, dtype=torch.int64)",
        ),
    ),
    Statements(
        path="vllm/v1/worker/gpu/model_runner.py",
        cls="GPUModelRunner",
        method="sample_tokens",
        snippets=(
            "self.speculator.observe_verification(input_batch.idx_mapping, num_sampled, "
            "num_rejected)",
        ),
    ),
    Statements(
        path=f"{_SPEC}/rejection_sampler_utils.py",
        cls="",
        method="rejection_sample",
        snippets=("num_sampled = sampled.new_empty(num_reqs, dtype=torch.int32)",),
    ),
    Statements(
        path="vllm/v1/worker/gpu/input_batch.py",
        cls="",
        method="get_num_sampled_and_rejected",
        snippets=("num_rejected = torch.empty_like(num_sampled)",),
    ),
    # The worker's life (avest_client.vllm.lifecycle): after load_model the shim knows
    # whether an estimator was built; shutdown runs in the worker's own process (vLLM's
    # WorkerProc calls it on its way out), where the shim sends its last round. The CPU
    # worker subclasses this class without overriding either method.
    Class(
        path="vllm/v1/worker/gpu_worker.py",
        name="Worker",
        methods=(
            Method("load_model", ("self", "load_dummy_weights")),
            Method("shutdown", ("self",)),
        ),
    ),
    # The engine core's shutdown, before it stops its executor: the shim closes the workers'
    # estimators through collective_rpc (a callable is run as func(worker) in each worker).
    Class(
        path="vllm/v1/engine/core.py",
        name="EngineCore",
        methods=(Method("shutdown", ("self",)),),
        init_attributes=("model_executor",),
    ),
    Statements(
        path="vllm/v1/engine/core.py",
        cls="EngineCore",
        method="shutdown",
        snippets=("self.model_executor.shutdown()",),
    ),
    Class(
        path="vllm/v1/executor/abstract.py",
        name="Executor",
        methods=(
            Method("collective_rpc", ("self", "method", "timeout", "args", "kwargs", "non_block")),
        ),
    ),
    # Plugin loading.
    Constant(
        path="vllm/plugins/__init__.py", name="DEFAULT_PLUGINS_GROUP", value="vllm.general_plugins"
    ),
    Function(path="vllm/plugins/__init__.py", name="load_general_plugins", params=()),
    # Tensor parallelism: rank 0 of the TP group talks to the sidecar and broadcasts.
    Function(path="vllm/distributed/parallel_state.py", name="get_tp_group", params=()),
    Class(
        path="vllm/distributed/parallel_state.py",
        name="GroupCoordinator",
        methods=(Method("broadcast_object", ("self", "obj", "src")),),
        init_attributes=("rank_in_group", "world_size"),
    ),
    # The pair (target, drafter, method) from the config current during load_model.
    ModuleName(
        path="vllm/config/__init__.py",
        name="get_current_vllm_config_or_none",
        from_module="vllm.config.vllm",
    ),
    Function(path="vllm/config/vllm.py", name="get_current_vllm_config_or_none", params=()),
    Class(
        path="vllm/config/vllm.py",
        name="VllmConfig",
        class_attributes=("model_config", "speculative_config"),
    ),
    Class(path="vllm/config/model.py", name="ModelConfig", class_attributes=("model",)),
    Class(
        path="vllm/config/speculative.py",
        name="SpeculativeConfig",
        class_attributes=(
            "model",
            "method",
            "num_speculative_tokens",
            "draft_sample_method",
            "enable_adaptive_verification",
            "num_speculative_tokens_per_batch_size",
        ),
    ),
    # Draft length by batch size (avest_client.vllm.schedule): the front end loads the
    # plugins in EngineArgs.__post_init__, then create_engine_config builds the speculative
    # config through create_speculative_config, which the plugin wraps; the engine core's
    # scheduler expands the schedule into its lookup when it is built.
    Class(
        path="vllm/engine/arg_utils.py",
        name="EngineArgs",
        methods=(
            Method(
                "create_speculative_config",
                ("self", "target_model_config", "target_parallel_config"),
            ),
        ),
    ),
    Statements(
        path="vllm/engine/arg_utils.py",
        cls="EngineArgs",
        method="__post_init__",
        snippets=("load_general_plugins()",),
    ),
    Statements(
        path="vllm/engine/arg_utils.py",
        cls="EngineArgs",
        method="create_engine_config",
        snippets=(
            "self.create_speculative_config(target_model_config=model_config, "
            "target_parallel_config=parallel_config)",
        ),
    ),
    Function(
        path="vllm/v1/spec_decode/dynamic/utils.py",
        name="build_dynamic_sd_schedule_lookup",
        params=(
            "num_speculative_tokens_per_batch_size",
            "vllm_max_batch_size",
            "vllm_num_speculative_tokens",
        ),
    ),
    Statements(
        path="vllm/v1/core/sched/scheduler.py",
        cls="Scheduler",
        method="__init__",
        snippets=(
            "build_dynamic_sd_schedule_lookup(speculative_config."
            "num_speculative_tokens_per_batch_size, vllm_max_batch_size=self.scheduler_config."
            "max_num_seqs, vllm_num_speculative_tokens=self.num_spec_tokens)",
        ),
    ),
    # Requests whose target sampling is transformed are flagged as they are added.
    Class(
        path="vllm/v1/worker/gpu/sample/sampler.py",
        name="Sampler",
        methods=(Method("add_request", ("self", "req_idx", "sampling_params")),),
    ),
    Class(
        path="vllm/sampling_params.py",
        name="SamplingParams",
        methods=(Method("bad_words_token_ids", ("self",)),),
        class_attributes=(
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "allowed_token_ids",
            "logit_bias",
            "bad_words",
            "structured_outputs",
        ),
    ),
    # The cost curves vLLM profiles at start-up (rank 0's values are broadcast).
    Class(
        path=f"{_SPEC}/adaptive_verification.py",
        name="AdaptiveVerificationManager",
        methods=(Method("set_cost_curves", ("self", "draft_curve", "verify_curve")),),
        # read (best effort, 0 if absent) to send the capture limit with the curves
        init_attributes=("_cudagraph_limit",),
    ),
)
