"""avest inside vLLM 0.33: the plugin and the estimator shim (vLLM-facing half).

What the shim relies on is listed in :mod:`.contract` and checked against
vLLM's source by ``tests/shim/test_vllm_contract.py``. Findings from vLLM
0.33.0's source (paths inside the wheel):

Estimator — ``v1/worker/gpu/spec_decode/acceptance_estimator.py``,
``OnlineAcceptanceEstimator(max_num_reqs, num_speculative_steps, device)``.
Class constants ``REFIT_INTERVAL = 100``, ``DAMPING_OBSERVATIONS = 50.0``,
``L2 = 1e-3``. ``__init__`` sets ``num_speculative_steps``, ``device``,
``_steps_since_refit = 0``, ``_refits = 0``; float32 tensors ``slope`` [1]
(0.5), ``intercepts`` [K] (-0.2), ``features`` and ``predictions``
[max_num_reqs, K] (slots keyed by request-state index), ``info`` [K, 3]
(a_k, b_k, c_k), ``grad`` [K, 2] (g0_k, g1_k), ``counts`` [K].

* ``step(idx_mapping, num_sampled, num_rejected)``: one Triton program per
  position accumulates the IRLS sums over the live requests (``features`` and
  the draft-time ``predictions`` gathered by ``idx_mapping``; a =
  max(s-1, 0), observed iff k <= a and k < a + rejected, label k < a), then
  ``_steps_since_refit += 1``; when it reaches ``REFIT_INTERVAL`` it is reset to
  0, the refit kernel does one damped Newton step in place on ``slope`` /
  ``intercepts`` and clears the sums, ``_refits += 1``. Runs eagerly, identically
  on every TP rank, no host sync.
* ``predict(logits, idx_mapping, draft_step, confidence_probs, temperature)``:
  runs inside the captured draft CUDA graph; per token, logits / temperature
  (temperature 0 -> unscaled), feature ``-log(max(Σ exp(z - m) - 1, 0))`` =
  logit(q_max) clamped to ±40 (the argmax's 1 is subtracted from the float32
  total), ``p = σ(slope·x + intercepts[step])`` written to ``features``,
  ``predictions`` and ``confidence_probs[batch, step]``; ``draft_step`` is a
  0-d tensor (one row per request) or per-token (K rows per request);
  ``idx_mapping < 0`` rows (graph padding) are skipped. It reads ``slope`` and
  ``intercepts`` by pointer: update them with ``copy_``, never rebind.
  (The feature and this kernel's float32 saturation: docs/design.md §1, §4.)

Speculator — ``spec_decode/speculator.py`` does ``from
...acceptance_estimator import OnlineAcceptanceEstimator`` at module level and,
in ``DraftModelSpeculator.load_model``, when ``use_acceptance_estimator``
(``enable_adaptive_verification``; DSpark turns it off when its model has a
confidence head), calls ``OnlineAcceptanceEstimator(self.max_num_reqs,
self.num_speculative_steps, self.device)`` through that module-level name, so
the plugin patches ``vllm.v1.worker.gpu.spec_decode.speculator.
OnlineAcceptanceEstimator`` (every speculator subclass inherits ``load_model``).
``observe_verification(idx_mapping, num_sampled, num_rejected)`` calls
``step`` from ``GPUModelRunner.sample_tokens`` after ``postprocess_sampled``
and before ``propose`` (which overwrites ``features``); num_sampled /
num_rejected are int32 [num_reqs] device tensors, idx_mapping int64.

Sampling params on the worker — the estimator sees none. The worker's
``Sampler.add_request(req_idx, sampling_params)``
(``v1/worker/gpu/sample/sampler.py``, same index space as ``idx_mapping``)
receives each request's ``SamplingParams``; its per-slot state is split across
``PenaltiesState.use_penalty``, ``LogitBiasState`` (allowed token ids, logit
bias, min tokens), ``BadWordsState`` and ``needs_logits_processing`` (which
also fires for temperature/top-p/top-k, so it is too broad). The plugin wraps
``add_request`` to keep one flag per slot (:mod:`.exclusion`).

Plugins — ``vllm/plugins/__init__.py``: ``load_general_plugins()`` loads the
entry-point group ``vllm.general_plugins`` once per process (API server via
arg parsing, engine core, every worker in ``WorkerWrapperBase.init_worker``
before the worker class is imported), filtered by ``VLLM_PLUGINS``
(comma-separated names; unset = all); a plugin whose load raises is logged
and skipped. Registration may run several times: it must be idempotent.

Tensor parallelism — ``vllm.distributed.parallel_state.get_tp_group()`` returns
a ``GroupCoordinator`` with ``rank_in_group``, ``world_size``, ``ranks``,
``cpu_group`` (gloo) and ``broadcast_object(obj, src=0)``, which for the TP
group goes through its shared-memory ``mq_broadcaster`` (world_size 1 returns
obj). vLLM uses it in ``AdaptiveVerificationManager.set_cost_curves``.

Cost curves — ``spec_decode/adaptive_verification.py``:
``AdaptiveVerificationManager.set_initial_cost_curves(samples)`` takes
start-up profiling timings (graph-replay drafter ms by request count, forward
ms by target token count; medians) and calls ``set_cost_curves(draft_curve,
verify_curve)`` (``[(size, ms)]`` lists), which broadcasts rank 0's over TP and
builds the cost tables. The estimator has no reference to the manager (the
model runner owns both), so the plugin wraps ``set_cost_curves`` (:mod:`.costs`).

Model names — not among the estimator's arguments, but the worker runs
``load_model`` under ``set_current_vllm_config``, so
``vllm.config.get_current_vllm_config_or_none()`` gives ``model_config.model``
(target), ``speculative_config.model`` (drafter), ``.method``,
``.num_speculative_tokens``, ``.draft_sample_method`` at construction (:mod:`.pair`).

Modules: :mod:`.plugin` (register, patch), :mod:`.hooks` (post-import hook),
:mod:`.estimator` (the subclass), :mod:`.coefficients` (who governs, TP
sync), :mod:`.transfer` + :mod:`.ringqueue` (capture, bounded drop-oldest
hand-off, forwarder thread), :mod:`.sink` (the seam to the network client),
:mod:`.tp`, :mod:`.config`, :mod:`.pair`, :mod:`.exclusion`, :mod:`.costs`,
:mod:`.contract` / :mod:`.contract_check`, :mod:`.schedule` (draft length by
batch size, set in vLLM's speculative config at engine start), :mod:`.sidecar` (the
production sink: registration, warm start, cost curves and the Observe stream
through ``avest_client``'s ``EstimatorClient`` and ``Forwarder``).
"""
