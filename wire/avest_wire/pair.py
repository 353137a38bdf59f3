"""The pair key: what identifies one estimator, and its stable id.

A pair is (target model, draft model, speculative method, K, free-form labels
such as the sampling temperature). Worker, client and service hold the same
key; the service derives the pair's id from it, so the same key gives the
same id in every process, forever (the store and every worker rely on it).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_K

#: Labels as given: a mapping, or ``(name, value)`` pairs.
LabelsIn = Mapping[str, str] | Iterable[tuple[str, str]] | None


class Labels(Mapping[str, str]):
    """A pair key's labels: a read-only mapping in name order, hashable like the key."""

    __slots__ = ("_items", "_map")

    def __init__(self, labels: LabelsIn = None) -> None:
        items = labels.items() if isinstance(labels, Mapping) else (labels or ())
        self._map = dict(sorted(dict(items).items()))
        self._items = tuple(self._map.items())

    def __getitem__(self, name: str) -> str:
        return self._map[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self._map == dict(other)

    def __repr__(self) -> str:
        return f"Labels({self._map!r})"


@dataclass(frozen=True)
class PairKey:
    """Models, method, K and labels (any mapping or ``(name, value)`` pairs; kept as
    :class:`Labels`). Nothing is checked here: a worker's key may still lack what its
    config did not say; :meth:`of` makes a key the service registers."""

    target: str
    draft: str
    method: str
    k: int
    labels: Labels = Labels()

    def __post_init__(self) -> None:
        if not isinstance(self.labels, Labels):
            object.__setattr__(self, "labels", Labels(self.labels))
        object.__setattr__(self, "method", self.method or "")
        object.__setattr__(self, "k", int(self.k))

    @classmethod
    def of(cls, target: str, draft: str, method: str, k: int, labels: LabelsIn = None) -> PairKey:
        """A key the service registers: both models named, ``1 <= K <= MAX_K``."""
        if not target:
            raise InvalidInput("target_model", "must not be empty")
        if not draft:
            raise InvalidInput("draft_model", "must not be empty")
        if not 1 <= k <= MAX_K:
            raise InvalidInput("num_speculative_tokens", f"K must be in [1, {MAX_K}], got {k}")
        return cls(target, draft, method, k, Labels(labels))

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "draft": self.draft,
            "method": self.method,
            "k": self.k,
            "labels": dict(self.labels),
        }

    @functools.cached_property
    def pair_id(self) -> str:
        """Stable id: the first 16 hex digits of the SHA-256 of the key's canonical JSON."""
        blob = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]
