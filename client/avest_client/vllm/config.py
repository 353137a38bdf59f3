"""Shim configuration from environment variables.

=====================  ==========  ===================================================
variable               default     meaning
=====================  ==========  ===================================================
``AVEST_ADDRESS``      (unset)     sidecar ``host:port``; unset = the plugin does nothing
``AVEST_TIMEOUT_S``    ``5.0``     network timeout used by the sink (connect, RPC)
``AVEST_QUEUE_SIZE``   ``64``      steps buffered between vLLM's step and the sink;
                                   the oldest is dropped (and counted) when full
``AVEST_LABELS``       (empty)     workload labels ``k=v,k=v`` added to the pair key
``AVEST_SYNC_STEPS``   ``16``      with tensor parallelism, rank 0 broadcasts the
                                   coefficients every this many steps
``AVEST_HARDWARE``     (empty)     hardware label of the cost curves sent to the
                                   sidecar; empty = the CUDA device name, else
                                   ``default``
``AVEST_MODE``         ``summary`` ``summary``: one round summary per round (vLLM's
                                   sums and a calibration sketch kept on the
                                   device); ``raw``: every step's drafts
``AVEST_RAW_SAMPLE``   ``0``       summary mode: also send this fraction of steps raw
                                   (0 to 1; e.g. for ``avest record``)
``AVEST_SKETCH``       ``1``       summary mode: keep the calibration sketch (0 = off;
                                   with strata the round still keeps its steps)
``AVEST_ROUND_STEPS``  ``0``       summary mode: steps per summary; 0 = vLLM's
                                   ``REFIT_INTERVAL`` (100). Longer rounds send
                                   fewer summaries (a sidecar's load is workers /
                                   round seconds); the sketch keeps this many steps'
                                   features on the device (two sets). At most 10,000
``AVEST_SCHEDULE``     ``0``       ``1``: at engine start, fetch the pair's draft
                                   length by batch size for ``AVEST_HARDWARE`` and
                                   set vLLM's ``num_speculative_tokens_per_batch_size``
                                   (:mod:`.schedule`); otherwise, or on any failure,
                                   the configured value governs
``AVEST_STRATA``       ``0``       ``1``: a coefficient set per request stratum
                                   (docs/strata.md): each slot predicted with its
                                   stratum's pushed set, one round summary per
                                   stratum; ``0``: exactly the shim without strata
``AVEST_STRATA_EDGES`` ``0.5,1``   temperature bucket edges of the strata
``AVEST_STRATA_LABEL`` (empty)     a key of the request's ``extra_args`` whose value
                                   prefixes its stratum (``code/greedy``)
=====================  ==========  ===================================================
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from avest_wire.errors import InvalidInput
from avest_wire.strata import DEFAULT_EDGES, check_edges

ENV_ADDRESS = "AVEST_ADDRESS"
ENV_TIMEOUT = "AVEST_TIMEOUT_S"
ENV_QUEUE = "AVEST_QUEUE_SIZE"
ENV_LABELS = "AVEST_LABELS"
ENV_SYNC = "AVEST_SYNC_STEPS"
ENV_HARDWARE = "AVEST_HARDWARE"
ENV_MODE = "AVEST_MODE"
ENV_RAW_SAMPLE = "AVEST_RAW_SAMPLE"
ENV_SKETCH = "AVEST_SKETCH"
ENV_ROUND_STEPS = "AVEST_ROUND_STEPS"
ENV_SCHEDULE = "AVEST_SCHEDULE"
ENV_STRATA = "AVEST_STRATA"
ENV_STRATA_EDGES = "AVEST_STRATA_EDGES"
ENV_STRATA_LABEL = "AVEST_STRATA_LABEL"
#: Most steps one summary may cover (the sketch keeps each step's features until then).
MAX_ROUND_STEPS = 10_000
MODES = ("summary", "raw")

_LABEL_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


class ConfigError(ValueError):
    """An environment variable holds a value the shim cannot use."""


@dataclass(frozen=True)
class ShimConfig:
    address: str | None = None
    timeout_s: float = 5.0
    queue_size: int = 64
    labels: tuple[tuple[str, str], ...] = ()
    sync_steps: int = 16
    hardware: str = ""
    mode: str = "summary"
    raw_sample: float = 0.0
    sketch: bool = True
    round_steps: int = 0
    schedule: bool = False
    strata: bool = False
    strata_edges: tuple[float, ...] = DEFAULT_EDGES
    strata_label: str = ""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"{ENV_MODE} must be summary or raw, got {self.mode!r}")
        if not (math.isfinite(self.raw_sample) and 0.0 <= self.raw_sample <= 1.0):
            raise ConfigError(f"{ENV_RAW_SAMPLE} must lie in [0, 1], got {self.raw_sample}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"{ENV_TIMEOUT} must be a positive number, got {self.timeout_s}")
        if self.queue_size < 1:
            raise ConfigError(f"{ENV_QUEUE} must be >= 1, got {self.queue_size}")
        if self.sync_steps < 1:
            raise ConfigError(f"{ENV_SYNC} must be >= 1, got {self.sync_steps}")
        if not 0 <= self.round_steps <= MAX_ROUND_STEPS:
            raise ConfigError(
                f"{ENV_ROUND_STEPS} must lie in [0, {MAX_ROUND_STEPS}], got {self.round_steps}"
            )
        if len(self.hardware.encode()) > 128:
            raise ConfigError(f"{ENV_HARDWARE} must be at most 128 bytes")
        try:
            check_edges(self.strata_edges)
        except InvalidInput as exc:
            raise ConfigError(f"{ENV_STRATA_EDGES}: {exc.problem}") from None
        if len(self.strata_label) > 128 or not self.strata_label.isprintable():
            raise ConfigError(f"{ENV_STRATA_LABEL} must be a printable key of <= 128 characters")

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ShimConfig:
        env = os.environ if environ is None else environ
        address = env.get(ENV_ADDRESS, "").strip() or None
        return cls(
            address=address,
            timeout_s=_number(env, ENV_TIMEOUT, 5.0, float),
            queue_size=_number(env, ENV_QUEUE, 64, int),
            labels=parse_labels(env.get(ENV_LABELS, "")),
            sync_steps=_number(env, ENV_SYNC, 16, int),
            hardware=env.get(ENV_HARDWARE, "").strip(),
            mode=env.get(ENV_MODE, "").strip().lower() or "summary",
            raw_sample=_number(env, ENV_RAW_SAMPLE, 0.0, float),
            sketch=env.get(ENV_SKETCH, "1").strip().lower() not in ("0", "false", "no", "off"),
            round_steps=_number(env, ENV_ROUND_STEPS, 0, int),
            schedule=_flag(env, ENV_SCHEDULE),
            strata=_flag(env, ENV_STRATA),
            strata_edges=_edges(env.get(ENV_STRATA_EDGES, "")),
            strata_label=env.get(ENV_STRATA_LABEL, "").strip(),
        )


def _edges(raw: str) -> tuple[float, ...]:
    raw = raw.strip()
    if not raw:
        return DEFAULT_EDGES
    try:
        return tuple(float(v) for v in raw.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{ENV_STRATA_EDGES}={raw!r} is not a list of numbers") from None


def _number(env: Mapping[str, str], name: str, default, kind):  # type: ignore[no-untyped-def]
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ConfigError(f"{name}={raw!r} is not 0 or 1")


def parse_labels(raw: str) -> tuple[tuple[str, str], ...]:
    """``"k=v,k2=v2"`` -> sorted ``(("k", "v"), ("k2", "v2"))``; empty items are ignored."""
    out: dict[str, str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _LABEL_KEY.match(key):
            raise ConfigError(f"{ENV_LABELS}: {item!r} is not k=v with a plain key")
        if key in out:
            raise ConfigError(f"{ENV_LABELS}: label {key!r} given twice")
        out[key] = value
    return tuple(sorted(out.items()))
