"""Cost profiles for ``avest simulate``: the ``avest-costs/1`` file format.

A profile is a small JSON object holding the measured (or derived) step-cost
curves that the core's :class:`~avest.core.costs.CostTable` turns into tables
with vLLM's semantics (running maximum, CUDA-graph padding up to the limit,
interpolation above it, extrapolation past the last point)::

    {
      "format": "avest-costs/1",
      "name": "l40s-llama8b",                 # short name, used in reports
      "description": "one line",
      "regime": "memory-bound small batches", # free text, optional
      "draft_per": "position",                # or "proposal"
      "cudagraph_limit": 512,                 # largest captured size; 0 = unknown
      "draft_curve": [[1, 1.36], [2, 1.36], ...],    # (requests, ms)
      "verify_curve": [[1, 23.7], [2, 23.7], ...],   # (target tokens, ms)
      "notes": ["where every number comes from", ...]
    }

``verify_curve`` is one target forward pass over ``T`` tokens. ``draft_curve``
depends on ``draft_per``:

* ``"position"`` (autoregressive drafters: a draft model, EAGLE, MTP): one
  draft forward pass at batch ``R``; a step that drafts ``k`` positions pays
  ``k`` passes, whatever is later trimmed.
* ``"proposal"`` (drafters whose cost does not grow with the number of
  positions, e.g. one parallel pass): the whole proposal at batch ``R``,
  paid once per step by every policy.

Shipped profiles live in the package as ``avest/data/costs-<name>.json``;
``load_profile`` takes either such a name or a path.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from avest.core.costs import CostTable, Curve, check_curve
from avest_wire.errors import InvalidInput

FORMAT = "avest-costs/1"
DRAFT_PER = ("position", "proposal")
_PREFIX, _SUFFIX = "costs-", ".json"

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


class ProfileError(ValueError):
    """A cost profile that does not follow ``avest-costs/1``."""


@dataclass(frozen=True)
class CostProfile:
    """Step-cost curves of one deployment (model pair, hardware, graph sizes)."""

    name: str
    draft_curve: tuple[tuple[int, float], ...]
    verify_curve: tuple[tuple[int, float], ...]
    cudagraph_limit: int
    draft_per: str = "position"
    description: str = ""
    regime: str = ""
    notes: tuple[str, ...] = ()
    source: str = ""

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> CostProfile:
        """Validate a parsed profile; raises :class:`ProfileError`."""
        where = f"{source}: " if source else ""
        if not isinstance(data, dict):
            raise ProfileError(f"{where}a cost profile must be a JSON object")
        if data.get("format") != FORMAT:
            raise ProfileError(f"{where}format must be {FORMAT!r}, got {data.get('format')!r}")
        missing = [k for k in ("name", "draft_curve", "verify_curve") if k not in data]
        if missing:
            raise ProfileError(f"{where}missing {missing}")
        draft_per = data.get("draft_per", "position")
        if draft_per not in DRAFT_PER:
            raise ProfileError(f"{where}draft_per must be one of {DRAFT_PER}, got {draft_per!r}")
        limit = data.get("cudagraph_limit", 0)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ProfileError(f"{where}cudagraph_limit must be an integer >= 0, got {limit!r}")
        curves = []
        for key in ("draft_curve", "verify_curve"):
            try:
                xs, ys = check_curve(data[key], key)
            except InvalidInput as exc:
                raise ProfileError(f"{where}{exc}") from None
            curves.append(tuple((int(x), float(y)) for x, y in zip(xs, ys, strict=True)))
        notes = data.get("notes", [])
        if isinstance(notes, str):
            notes = [notes]
        return cls(
            name=str(data["name"]),
            draft_curve=curves[0],
            verify_curve=curves[1],
            cudagraph_limit=limit,
            draft_per=draft_per,
            description=str(data.get("description", "")),
            regime=str(data.get("regime", "")),
            notes=tuple(str(n) for n in notes),
            source=source,
        )

    @classmethod
    def from_curves(
        cls,
        name: str,
        draft_curve: Curve,
        verify_curve: Curve,
        cudagraph_limit: int = 0,
        draft_per: str = "position",
    ) -> CostProfile:
        """A profile built in code (tests, notebooks), validated like a file."""
        return cls.from_dict(
            {
                "format": FORMAT,
                "name": name,
                "draft_curve": [list(p) for p in draft_curve],
                "verify_curve": [list(p) for p in verify_curve],
                "cudagraph_limit": cudagraph_limit,
                "draft_per": draft_per,
            }
        )

    def as_json(self) -> dict[str, Any]:
        """What describes the profile (its curves are the tables it builds)."""
        described = ("name", "description", "regime", "draft_per", "cudagraph_limit", "source")
        return {name: getattr(self, name) for name in described}

    def step_costs(self, k: int, max_requests: int, max_tokens: int) -> StepCosts:
        """Tables for a trace with ``k`` draft positions (see :class:`StepCosts`)."""
        sizes = {"max_requests": max(max_requests, 1), "max_tokens": max(max_tokens, 1)}
        per_pass = CostTable.from_curves(
            self.draft_curve, self.verify_curve, self.cudagraph_limit, **sizes
        )
        return StepCosts(self, per_pass, k, sizes)


@dataclass(frozen=True, eq=False)
class StepCosts:
    """What one simulated step costs, and the tables the budget rules see.

    ``budget(d).draft_cost(R)`` is the cost of drafting ``d`` positions for
    ``R`` requests (what an adaptive-verification step has already paid when
    it sizes its budget); its verify cost is the profile's verify curve.
    """

    profile: CostProfile
    per_pass: CostTable
    k: int
    sizes: dict[str, int]
    _budget: dict[int, CostTable] = field(default_factory=dict, repr=False)

    def passes(self, drafted: int) -> int:
        """Draft forward passes of a step that drafts ``drafted`` positions."""
        if self.profile.draft_per == "position":
            return drafted
        return 1 if drafted else 0

    def draft_ms(self, requests: int, drafted: int) -> float:
        """Draft cost of a step of ``requests`` that drafts ``drafted`` positions."""
        return self.passes(drafted) * self.per_pass.draft_cost(requests)

    def verify_ms(self, tokens: npt.ArrayLike) -> FloatArray:
        """Verify cost of steps of ``tokens`` target tokens each."""
        return np.asarray(self.per_pass.verify_cost(np.asarray(tokens, dtype=np.int64)))

    def budget(self, drafted: int) -> CostTable:
        """The table a budget rule sees in a step that drafted ``drafted`` positions."""
        table = self._budget.get(drafted)
        if table is None:
            p = self.profile
            scale = self.passes(drafted)
            proposal = [(s, scale * ms) for s, ms in p.draft_curve]
            table = CostTable.from_curves(proposal, p.verify_curve, p.cudagraph_limit, **self.sizes)
            self._budget[drafted] = table
        return table


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped in the package, sorted."""
    data = resources.files("avest").joinpath("data")
    names = [
        p.name[len(_PREFIX) : -len(_SUFFIX)]
        for p in data.iterdir()
        if p.name.startswith(_PREFIX) and p.name.endswith(_SUFFIX)
    ]
    return sorted(names)


def load_profile(name_or_path: str | os.PathLike[str]) -> CostProfile:
    """A shipped profile by name, or a profile file by path."""
    text_name = os.fspath(name_or_path)
    path = Path(text_name)
    if not path.is_file():
        if text_name in shipped_profiles():
            ref = resources.files("avest").joinpath("data", f"{_PREFIX}{text_name}{_SUFFIX}")
            return CostProfile.from_dict(json.loads(ref.read_text()), source=text_name)
        raise ProfileError(
            f"no cost profile {text_name!r}: not a file, nor a shipped profile "
            f"({', '.join(shipped_profiles())})"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read a JSON cost profile: {exc}") from None
    return CostProfile.from_dict(data, source=str(path))
