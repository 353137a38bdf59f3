"""The estimator vLLM's speculator builds when the plugin is active.

:func:`make_sidecar_estimator` subclasses whatever estimator class it is given
(vLLM's ``OnlineAcceptanceEstimator``, a platform's replacement, or the CPU
stand-in in tests). Everything vLLM does on the device is kept: ``predict`` is
untouched, ``step`` still runs vLLM's accumulate and refit kernels. Around the
base ``step`` the subclass:

* at the step boundary (before the base step), asks the :class:`Governor`
  what governs and copies new pooled coefficients *into* ``slope`` and
  ``intercepts`` (same storage: the captured draft graph reads them);
* while pooled coefficients govern, skips the refit the base would run this
  step by resetting its counter, and clears the round statistics exactly as
  the refit would (so a later local refit starts from a clean round);
* after the base step, snapshots the step for the sink (rank 0 only);
* after the base ``predict``, maps its confidences through the pair's
  calibration table while it is served (:mod:`avest_client.vllm.calibration`);
* with strata (``AVEST_STRATA=1``, :mod:`avest_client.vllm.strata`), predicts each
  slot whose stratum has a pushed set with that set, and sums each stratum's
  drafts apart for its own round summary.

Any failure to set the sidecar up leaves a plain base estimator: vLLM keeps
serving with its own refits.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from avest_client.types import Served
from avest_client.vllm import contract, lifecycle
from avest_client.vllm import strata as strata_mod
from avest_client.vllm.calibration import TableSync
from avest_client.vllm.coefficients import Governor
from avest_client.vllm.config import ShimConfig
from avest_client.vllm.exclusion import ExclusionRegistry
from avest_client.vllm.prom import Exporter
from avest_client.vllm.rounds import SummaryRound
from avest_client.vllm.sink import Sink
from avest_client.vllm.strata import StrataState, StrataSync
from avest_client.vllm.tp import SingleProcessGroup, TPGroup
from avest_client.vllm.transfer import StepTransfer
from avest_wire.pair import PairKey

logger = logging.getLogger(__name__)

SinkFactory = Callable[[ShimConfig, PairKey], Sink]


@dataclass
class ShimOptions:
    config: ShimConfig
    sink_factory: SinkFactory
    #: the pair served, from the estimator's K (production: the current vLLM config)
    pair_resolver: Callable[[int], PairKey]
    #: the TP group (production: vLLM's; tests: gloo)
    group_resolver: Callable[[], TPGroup] = SingleProcessGroup
    exclusion: ExclusionRegistry | None = None


class _Runtime:
    """The shim's per-estimator state, kept apart from the base class's attributes."""

    def __init__(self, est: Any, max_num_reqs: int, opts: ShimOptions) -> None:
        k = int(est.num_speculative_steps)
        self.group = opts.group_resolver()
        self.mode = opts.config.mode
        #: Summary mode: send every this-many-th step raw as well (0 = none).
        rate = opts.config.raw_sample if self.mode == "summary" else 0.0
        self.raw_every = max(1, round(1.0 / rate)) if rate > 0 else 0
        self.rounds: SummaryRound | None = None
        #: Strata (AVEST_STRATA=1) on every rank: the per-slot table predict reads.
        self.strata: StrataState | None = None
        self.strata_sync: StrataSync | None = None
        if opts.config.strata:
            try:
                registry = strata_mod.REGISTRY
                registry.configure(opts.config.strata_edges, opts.config.strata_label)
                registry.enabled = True
                self.strata = StrataState(max_num_reqs, k, est.features.device)
            except Exception:  # noqa: BLE001 - without strata: the pair's set for all
                logger.exception("avest: strata setup failed; one coefficient set serves")
        self.exporter: Exporter | None = None
        self.sink: Sink | None = None
        self.transfer: StepTransfer | None = None
        self.pair: PairKey | None = None
        if self.group.rank == 0:
            # Rank 0 alone talks to the sidecar. Nothing here may fail the
            # constructor: the other ranks would build a governor and wait in
            # broadcasts that rank 0 never joins.
            try:
                self.pair = opts.pair_resolver(k)
                self.sink = opts.sink_factory(opts.config, self.pair)
            except Exception as exc:  # noqa: BLE001 - no sidecar: vLLM's own estimator
                logger.warning("avest: no sink (%s); local refits only", exc)
            if self.sink is not None and opts.config.mode == "summary":
                try:
                    self.rounds = SummaryRound(
                        self.sink, k, est.features.device, opts.config.sketch,
                        max_num_reqs=max_num_reqs,
                        round_steps=opts.config.round_steps or int(est.REFIT_INTERVAL),
                        strata=self.strata,
                    )  # fmt: skip
                except Exception:  # noqa: BLE001
                    logger.exception("avest: summary mode setup failed; not forwarding")
            if self.sink is not None and (opts.config.mode == "raw" or self.raw_every):
                try:
                    self.transfer = StepTransfer(
                        self.sink, max_num_reqs, k, est.features.device,
                        opts.config.queue_size, opts.exclusion,
                        strata=strata_mod.REGISTRY if self.strata is not None else None,
                    )  # fmt: skip
                except Exception:  # noqa: BLE001
                    logger.exception("avest: step transfer setup failed; not forwarding")
        self.governor = Governor(self.group, self.sink, k, opts.config.sync_steps)
        self.tables = TableSync(self.group, self.sink, opts.config.sync_steps, est.slope.device)
        if self.strata is not None:
            self.strata_sync = StrataSync(self.group, self.sink, opts.config.sync_steps, k)
        self.skipped_refits = 0
        self.steps = 0
        self._forward_failed = False
        self.closed = False

    def apply(self, est: Any, update: Served) -> None:
        values = torch.tensor((update.slope, *update.intercepts), dtype=torch.float32)
        if est.slope.device.type == "cuda":
            # Pinned source + non_blocking: the copy is stream-ordered and the
            # host never waits. The caching host allocator keeps the buffer
            # alive until the copy has run.
            values = values.pin_memory()
        est.slope.copy_(values[:1], non_blocking=True)
        est.intercepts.copy_(values[1:], non_blocking=True)

    def forward(self, est: Any, idx_mapping: Any, num_sampled: Any, num_rejected: Any) -> None:
        fwd = self.transfer
        if fwd is None or self._forward_failed:
            return
        try:
            fwd.capture(est.features, idx_mapping, num_sampled, num_rejected)
        except Exception:  # noqa: BLE001 - stop forwarding, keep decoding
            self._forward_failed = True
            logger.exception("avest: capturing a step failed; forwarding disabled")

    def summary_step(self, est: Any, base_step: Any, update: Served | None,
                     idx_mapping: Any, num_sampled: Any, num_rejected: Any) -> None:  # fmt: skip
        """One step in summary mode (see :mod:`avest_client.vllm.rounds`)."""
        rounds = self.rounds
        assert rounds is not None
        recording = rounds.version is not None
        st = self.strata
        if recording:
            # keep what the round's sketch needs before vLLM's next propose overwrites it
            rounds.record(est, idx_mapping, num_sampled, num_rejected)
        if update is not None:
            # before the base step, as in raw mode: the step's sums use the
            # stored predictions, and the next draft graph reads the new values
            self.apply(est, update)
        governed = self.governor.governed
        self.tables.boundary(governed)
        sets, pend = self.strata_boundary(governed)
        if governed and est._steps_since_refit + 1 >= est.REFIT_INTERVAL:
            est._steps_since_refit = -1  # the pooled round replaces vLLM's local refit
            base_step(idx_mapping, num_sampled, num_rejected)
            self.skipped_refits += 1
        else:
            base_step(idx_mapping, num_sampled, num_rejected)
        if recording:
            steps = rounds.steps = rounds.steps + 1
            # a new strata table ends the round: each round is summed at one table
            if update is not None or not governed or steps >= rounds.round_steps or pend:
                rounds.end(est, zero=governed)
                if not governed:
                    rounds.stop()
        if update is not None:
            if rounds.version is None:
                rounds.zero(est)  # drop the local partial round: pooled coefficients govern
            rounds.start(update.version, update.slope, update.intercepts)
        if pend:
            assert st is not None
            st.load(sets, governed)
        if self.raw_every:
            self.steps += 1
            if self.steps % self.raw_every == 0:
                self.forward(est, idx_mapping, num_sampled, num_rejected)

    def strata_boundary(self, governed: bool) -> tuple[tuple[Any, ...], bool]:
        """The strata sets pushed now and whether the table must load them (every rank
        decides alike); ``((), False)`` without strata."""
        st, sync = self.strata, self.strata_sync
        if st is None or sync is None:
            return (), False
        sets = sync.boundary()
        return sets, st.pending(sets, governed)

    def stats(self) -> dict[str, Any]:
        fwd = self.transfer
        rounds = self.rounds
        return {
            "mode": self.mode,
            "summaries": rounds.summaries if rounds else 0,
            "summary_errors": rounds.send_errors if rounds else 0,
            "sketches_skipped": rounds.sketches_skipped if rounds else 0,
            "strata_rounds_pooled": rounds.strata_rounds_pooled if rounds else 0,
            "reached_skipped": rounds.reached_skipped if rounds else 0,
            "copy_mode": rounds.copy_mode if rounds else False,
            "local_refits": None,  # filled by the estimator (vLLM's own refit counter)
            "governed": self.governor.governed,
            "version": self.governor.applied_version,
            "updates": self.governor.updates,
            "skipped_refits": self.skipped_refits,
            "captured": fwd.captured if fwd else 0,
            "submitted": fwd.submitted if fwd else 0,
            "dropped": fwd.dropped if fwd else 0,
            "submit_errors": fwd.submit_errors if fwd else 0,
            # the sink's own counters, where it keeps any (the sidecar sink does)
            "sink": getattr(self.sink, "stats", None),
            "strata": None if self.strata is None else self.strata.stats(),
        }

    def close(self, est: Any = None, timeout: float | None = None) -> None:
        """Stop forwarding; ``est`` given: its open round is sent first (vLLM's sums
        are left as they are). ``timeout``: the most seconds to wait for the sidecar's
        acknowledgements (default the sink's ``AVEST_TIMEOUT_S``). Only the first call
        does anything."""
        if self.closed:
            return
        self.closed = True
        if self.exporter is not None:
            self.exporter.close()
        if self.rounds is not None:
            if est is not None:
                try:
                    self.rounds.end(est, zero=False)
                except Exception:  # noqa: BLE001 - shutting down: never raise into vLLM
                    logger.exception("avest: sending the last round failed")
            self.rounds.flush(2.0 if timeout is None else timeout / 2)
            self.rounds.close()
        if self.transfer is not None:
            self.transfer.close()
        if self.strata is not None:
            self.strata.close()
        if self.sink is not None:
            try:
                if timeout is None:
                    self.sink.close()
                else:
                    self.sink.close(timeout / 2)
            except Exception:  # noqa: BLE001
                logger.exception("avest: closing the sink failed")


def _close_runtime(rt: _Runtime) -> None:
    rt.close()


def _stats_reader(ref: weakref.ReferenceType[Any]) -> Callable[[], dict[str, Any]]:
    """The estimator's ``avest_stats`` without keeping the estimator alive."""

    def read() -> dict[str, Any]:
        est = ref()
        return {} if est is None else dict(est.avest_stats())

    return read


def make_sidecar_estimator(
    base_cls: type,
    sink_factory: SinkFactory,
    *,
    config: ShimConfig | None = None,
    pair_resolver: Callable[[int], PairKey] | None = None,
    group_resolver: Callable[[], TPGroup] | None = None,
    exclusion: ExclusionRegistry | None = None,
) -> type:
    """A subclass of ``base_cls`` that forwards steps and applies pooled coefficients.

    ``sink_factory(config, pair_key)`` runs on TP rank 0 only, inside the
    estimator's constructor (after vLLM forked the worker). ``pair_resolver(K)``
    names the pair (default: anonymous, with the configured labels);
    ``group_resolver()`` gives the TP group (default: a single process).
    """
    cfg = config or ShimConfig()
    opts = ShimOptions(
        config=cfg,
        sink_factory=sink_factory,
        pair_resolver=pair_resolver or (lambda k: PairKey("", "", "", k, cfg.labels)),
        group_resolver=group_resolver or SingleProcessGroup,
        exclusion=exclusion,
    )

    class AvestSidecarEstimator(base_cls):  # type: ignore[misc, valid-type]
        __avest_shim__ = True
        __avest_base__ = base_cls

        def __init__(self, max_num_reqs: int, num_speculative_steps: int, device: Any) -> None:
            super().__init__(max_num_reqs, num_speculative_steps, device)
            self._avest: _Runtime | None = None
            missing = [a for a in contract.ESTIMATOR.init_attributes if not hasattr(self, a)]
            if missing:
                logger.error("avest: %s lacks %s; shim disabled", base_cls.__name__, missing)
                return
            try:
                rt = _Runtime(self, max_num_reqs, opts)
            except Exception:  # noqa: BLE001 - setup failed: plain vLLM estimator
                logger.exception("avest: shim setup failed; vLLM's estimator runs alone")
                return
            self._avest = rt
            if rt.sink is not None:
                rt.exporter = Exporter(_stats_reader(weakref.ref(self)))
            weakref.finalize(self, _close_runtime, rt)
            lifecycle.track(self)

        def step(self, idx_mapping: Any, num_sampled: Any, num_rejected: Any) -> None:
            rt = self._avest
            if rt is None:
                return super().step(idx_mapping, num_sampled, num_rejected)
            update = rt.governor.boundary()
            if rt.rounds is not None:
                rt.summary_step(self, super().step, update, idx_mapping, num_sampled, num_rejected)
                return None
            if update is not None:
                rt.apply(self, update)
            rt.tables.boundary(rt.governor.governed)
            sets, pend = rt.strata_boundary(rt.governor.governed)
            if pend:
                assert rt.strata is not None
                rt.strata.load(sets, rt.governor.governed)
            if rt.governor.governed and self._steps_since_refit + 1 >= self.REFIT_INTERVAL:
                # The base would refit in this step: let it accumulate, then
                # end the round without moving the pooled coefficients.
                self._steps_since_refit = -1
                super().step(idx_mapping, num_sampled, num_rejected)
                self.info.zero_()
                self.grad.zero_()
                self.counts.zero_()
                rt.skipped_refits += 1
            else:
                super().step(idx_mapping, num_sampled, num_rejected)
            rt.forward(self, idx_mapping, num_sampled, num_rejected)

        def predict(
            self,
            logits: Any,
            idx_mapping: Any,
            draft_step: Any,
            confidence_probs: Any,
            temperature: Any,
        ) -> None:
            super().predict(logits, idx_mapping, draft_step, confidence_probs, temperature)
            rt = self._avest
            if rt is not None:  # the pair's calibration layer, on the device
                rt.tables.map.apply(
                    self, logits.shape[0], idx_mapping, draft_step, confidence_probs
                )
                if rt.strata is not None:  # each slot's stratum set, where one is served
                    rt.strata.apply(
                        self, logits.shape[0], idx_mapping, draft_step, confidence_probs
                    )

        def avest_stats(self) -> dict[str, Any]:
            if self._avest is None:
                return {}
            out = self._avest.stats()
            out["local_refits"] = int(getattr(self, "_refits", 0))
            return out

        def avest_close(self, timeout: float | None = None) -> None:
            if self._avest is not None:
                self._avest.close(self, timeout)

    AvestSidecarEstimator.__name__ = AvestSidecarEstimator.__qualname__ = (
        f"AvestSidecar{base_cls.__name__}"
    )
    return AvestSidecarEstimator
