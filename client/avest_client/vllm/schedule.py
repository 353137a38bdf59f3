"""Draft length by batch size: the pair's schedule set in vLLM's config at engine start.

vLLM's ``speculative_config.num_speculative_tokens_per_batch_size`` is a list of
inclusive ranges ``(range_start, range_end, num_speculative_tokens)``; the
scheduler expands it once, when the engine core builds it, into a lookup from the
step's batch size to its draft length (0 allowed). vLLM's config reads it earlier
still (CUDA-graph capture sizes per draft length), so it must be in the
``SpeculativeConfig`` the front end builds: vLLM loads the plugins in
``EngineArgs.__post_init__`` and builds that config in
``EngineArgs.create_speculative_config``, called by ``create_engine_config``
before anything reads the schedule. The plugin wraps that method (docs/vllm.md,
"Draft length by batch size").

With ``AVEST_SCHEDULE=1`` (and ``AVEST_HARDWARE``, the label the workers' cost
curves are stored under) the wrapper fetches the pair's schedule through
:data:`FETCH`, bounded by ``AVEST_TIMEOUT_S``, checks it against vLLM's own
rules and sets it. Without opt-in, or on any failure, the configured value
governs. Either way it logs exactly one line saying which governs, and it never
fails the engine.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

from avest_client.vllm.config import ENV_HARDWARE, ENV_SCHEDULE, ShimConfig
from avest_client.vllm.pair import pair_from_vllm_config
from avest_wire.pair import PairKey

logger = logging.getLogger(__name__)

#: vLLM's field and the module that builds its lookup.
FIELD = "num_speculative_tokens_per_batch_size"
LOOKUP_MODULE = "vllm.v1.spec_decode.dynamic.utils"
LOOKUP_FUNCTION = "build_dynamic_sd_schedule_lookup"

Entry = tuple[int, int, int]
Schedule = list[Entry]
#: ``fetch(pair_key, hardware)``: the pair's schedule for that hardware, or None when
#: there is none (yet). It may raise; it may block (the caller bounds it). It runs in the
#: front end before vLLM starts its engine core (forked by default), so it should close
#: any channel it opens before it returns.
FetchSchedule = Callable[[PairKey, str], "Schedule | None"]

#: Where the schedule comes from. None: the sidecar at ``AVEST_ADDRESS``
#: (:func:`sidecar_fetch`); with no address either, the configured value governs.
FETCH: FetchSchedule | None = None


def sidecar_fetch(config: ShimConfig) -> FetchSchedule | None:
    """The schedule from the sidecar at ``config.address`` (``GetSchedule``, token and
    TLS from the environment as every client reads them), over a channel of its own
    that is closed before it returns; None when no address is set. A pair with too
    little evidence yet, or no cost curves for the label, has no schedule (None)."""
    if not config.address:
        return None
    address = config.address

    def fetch(pair: PairKey, hardware: str) -> Schedule | None:
        from avest_client import EstimatorClient, FailedPreconditionError, NotFoundError

        with EstimatorClient(address, timeout=config.timeout_s) as client:
            try:
                return client.schedule(pair.pair_id, hardware).to_vllm()
            except (FailedPreconditionError, NotFoundError):
                return None  # decide() says so in its one line

    return fetch


class ScheduleError(ValueError):
    """A schedule vLLM would refuse (or could misread)."""


def check_schedule(schedule: object, k: int) -> Schedule:
    """``schedule`` as vLLM's lookup reads it (sorted by range start), or ScheduleError.

    vLLM's rules (``validate_and_normalize_dynamic_sd_schedule``): a non-empty list of
    3-item entries, positive ranges with start <= end, lengths >= 0, non-overlapping once
    sorted, the first starting at 1. Stricter here: whole numbers only (vLLM truncates
    ``int(x)``), and K >= 1 (vLLM's lookup refuses K = 0). Lengths above K are kept: vLLM
    caps them at K.
    """
    if k < 1:
        raise ScheduleError(f"num_speculative_tokens must be >= 1 for a schedule, got {k}")
    if not isinstance(schedule, list | tuple) or not schedule:
        raise ScheduleError("a schedule is a non-empty list of (start, end, length)")
    entries: Schedule = []
    for entry in schedule:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ScheduleError(f"entry {entry!r} is not (start, end, length)")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in entry):
            raise ScheduleError(f"entry {entry!r} holds a value that is not a whole number")
        start, end, length = entry
        if start < 1 or start > end:
            raise ScheduleError(f"entry {entry!r}: the range must have 1 <= start <= end")
        if length < 0:
            raise ScheduleError(f"entry {entry!r}: the draft length must be >= 0")
        entries.append((start, end, length))
    entries.sort(key=lambda e: e[0])
    if entries[0][0] != 1:
        raise ScheduleError("the first range must start at batch size 1")
    for (_, end, _), (start, _, _) in zip(entries, entries[1:], strict=False):
        if start <= end:
            raise ScheduleError("ranges overlap")
    return entries


def lookup(schedule: Schedule, max_batch: int, k: int) -> list[int]:
    """The draft length per batch size 1..max_batch (index 0 unused), as vLLM expands it:
    inclusive ranges, a gap takes the previous range's length, sizes past the last range
    take its length, every length capped at K."""
    table = [0] * (max_batch + 1)
    for size in range(1, max_batch + 1):
        length = next(n for start, _, n in reversed(schedule) if start <= size)
        table[size] = min(length, k)
    return table


def fetch_bounded(fetch: FetchSchedule, pair: PairKey, hardware: str, timeout_s: float) -> Any:
    """``fetch(pair, hardware)`` on a daemon thread, waited for at most ``timeout_s``.

    Raises TimeoutError when it has not returned by then (the thread is left to finish
    on its own) and re-raises what it raised.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fetch(pair, hardware)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="avest-schedule", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no schedule within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass(frozen=True)
class Decision:
    """What governs: ``schedule`` set (the sidecar's) or None (the configured value), and
    the one line that says so."""

    schedule: Schedule | None
    line: str
    warn: bool = False


def decide(
    spec: Any,
    target_model_config: Any,
    target_parallel_config: Any,
    config: ShimConfig,
    fetch: FetchSchedule | None,
    vllm_check: Callable[[Schedule, int], object] | None = None,
) -> Decision:
    """Whether the sidecar's schedule or the configured value governs, and why."""
    configured = getattr(spec, FIELD, None)
    keep = f"the configured {FIELD} governs ({configured!r})"

    def fallback(why: str, warn: bool = True) -> Decision:
        return Decision(None, f"avest: draft length by batch size: {keep}: {why}", warn)

    if not config.schedule:
        return fallback(f"{ENV_SCHEDULE} is off", warn=False)
    if not hasattr(spec, FIELD):
        return fallback(f"this vLLM has no {FIELD}")
    if int(getattr(target_parallel_config, "data_parallel_size", 1) or 1) > 1:
        return fallback("vLLM turns the schedule off under data parallelism")
    if not config.hardware:
        return fallback(f"{ENV_SCHEDULE} needs {ENV_HARDWARE}, the workers' cost-curve label")
    if fetch is None:
        return fallback("no schedule source")
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
    if k < 1:
        return fallback(f"num_speculative_tokens must be >= 1 for a schedule, got {k}")
    holder = SimpleNamespace(model_config=target_model_config, speculative_config=spec)
    pair = pair_from_vllm_config(holder, k, config.labels)
    try:
        fetched = fetch_bounded(fetch, pair, config.hardware, config.timeout_s)
    except Exception as exc:  # noqa: BLE001 - the configured value governs instead
        return fallback(f"fetching the schedule failed: {type(exc).__name__}: {exc}")
    if fetched is None:
        return fallback(f"the sidecar has no schedule for this pair on {config.hardware!r}")
    try:
        schedule = check_schedule(fetched, k)
        if vllm_check is not None:
            vllm_check(schedule, k)
    except Exception as exc:  # noqa: BLE001 - vLLM would refuse it at start
        return fallback(f"the sidecar's schedule {fetched!r} is refused: {exc}")
    replaced = f", replacing the configured {configured!r}" if configured else ""
    return Decision(
        schedule,
        f"avest: draft length by batch size: the sidecar's schedule governs for "
        f"{config.hardware!r}: {schedule}{replaced}",
    )


def vllm_lookup_check(schedule: Schedule, k: int) -> object:
    """vLLM's own check (its lookup builder), where this vLLM has one."""
    import importlib

    build = getattr(importlib.import_module(LOOKUP_MODULE), LOOKUP_FUNCTION)
    return build(schedule, vllm_max_batch_size=schedule[-1][1], vllm_num_speculative_tokens=k)


def apply(
    spec: Any,
    target_model_config: Any,
    target_parallel_config: Any,
    config: ShimConfig,
    fetch: FetchSchedule | None,
    vllm_check: Callable[[Schedule, int], object] | None = vllm_lookup_check,
) -> Decision:
    """Decide, log the one line, and set the schedule when the sidecar's governs."""
    try:
        decision = decide(
            spec, target_model_config, target_parallel_config, config, fetch, vllm_check
        )
    except Exception as exc:  # noqa: BLE001 - never fail the engine
        decision = Decision(
            None,
            f"avest: draft length by batch size: the configured {FIELD} governs: "
            f"{type(exc).__name__}: {exc}",
            True,
        )
    if decision.schedule is not None:
        setattr(spec, FIELD, list(decision.schedule))
    (logger.warning if decision.warn else logger.info)("%s", decision.line)
    return decision


def install(
    module: ModuleType,
    config: ShimConfig,
    fetch: FetchSchedule | None = None,
    vllm_check: Callable[[Schedule, int], object] | None = vllm_lookup_check,
) -> bool:
    """Wrap ``module.EngineArgs.create_speculative_config`` (``vllm.engine.arg_utils``) so
    that the config it returns carries the decided schedule; idempotent. ``fetch`` None
    reads :data:`FETCH` at each call; ``vllm_check`` is vLLM's own check of a schedule."""
    cls = getattr(module, "EngineArgs", None)
    original = getattr(cls, "create_speculative_config", None)
    if original is None:
        logger.warning("avest: vLLM has no EngineArgs.create_speculative_config; "
                       "draft length by batch size is left to vLLM's config")  # fmt: skip
        return False
    if getattr(original, "__avest_wrapped__", False):
        return True

    @functools.wraps(original)
    def create_speculative_config(
        self: Any, target_model_config: Any, target_parallel_config: Any
    ) -> Any:
        spec = original(self, target_model_config, target_parallel_config)
        if spec is not None:
            source = fetch or FETCH or sidecar_fetch(config)
            apply(spec, target_model_config, target_parallel_config, config,
                  source, vllm_check)  # fmt: skip
        return spec

    create_speculative_config.__avest_wrapped__ = True  # type: ignore[attr-defined]
    cls.create_speculative_config = create_speculative_config  # type: ignore[union-attr]
    return True
