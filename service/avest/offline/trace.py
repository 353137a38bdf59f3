"""Read, validate and write ``avest-trace/1`` archives (see TRACE.md).

A trace is one row per (decode step, request): the drafts' features and the
verification counts they earned. Reading validates everything a consumer
relies on (dtypes, shapes, K, count ranges, feature range, step order, the
meta JSON) and raises :class:`TraceError` naming the array and the problem,
so a bad file fails at the door rather than as a shape error deep in a replay.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from avest.core.labels import labels
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_LOG_ODDS
from avest_wire.strata import check_stratum, stratum_of

FORMAT = "avest-trace/1"
#: Meta keys every trace carries (TRACE.md); anything else is free-form.
META_KEYS = (
    "format",
    "target",
    "draft",
    "method",
    "num_speculative_tokens",
    "temperature",
    "top_p",
)
REQUIRED_ARRAYS = ("meta", "features", "num_verified", "num_accepted", "step", "request")
#: Optional per-draft arrays: oracles and comparisons, never estimator inputs.
OPTIONAL_ARRAYS = ("logit_q_sampled", "accept_prob_token", "accept_rate_dist")
_PROBABILITY_ARRAYS = ("accept_prob_token", "accept_rate_dist")
#: Optional per-row array: each row's stratum (a string, see avest_wire.strata);
#: without it every row is in the stratum of the meta's temperature.
STRATUM_ARRAY = "stratum"
#: The bundled sample trace, inside the ``avest`` package.
SAMPLE_NAME = "sample-chat-k5.npz"


class TraceError(ValueError):
    """A trace that does not follow ``avest-trace/1``.

    ``array`` names the offending array (``"meta"`` for the JSON, ``"file"``
    for the archive itself) and ``problem`` says what is wrong with it.
    """

    def __init__(
        self, array: str, problem: str, path: str | os.PathLike[str] | None = None
    ) -> None:
        where = f"{os.fspath(path)}: " if path is not None else ""
        super().__init__(f"{where}array {array!r}: {problem}")
        self.array = array
        self.problem = problem
        self.path = path


@dataclass(frozen=True, eq=False)
class Trace:
    """One trace in memory. Arrays hold the dtypes of the file format.

    Constructing one does not validate it (slices are cheap); :meth:`validate`
    does, and :func:`read_trace` / :func:`write_trace` call it.
    """

    features: npt.NDArray[np.float32]
    num_verified: npt.NDArray[np.int32]
    num_accepted: npt.NDArray[np.int32]
    step: npt.NDArray[np.int64]
    request: npt.NDArray[np.int64]
    meta: dict[str, Any] = field(default_factory=dict)
    logit_q_sampled: npt.NDArray[np.float32] | None = None
    accept_prob_token: npt.NDArray[np.float32] | None = None
    accept_rate_dist: npt.NDArray[np.float32] | None = None
    stratum: npt.NDArray[np.str_] | None = None

    @property
    def k(self) -> int:
        return int(self.features.shape[1])

    @property
    def rows(self) -> int:
        return int(self.features.shape[0])

    @property
    def num_steps(self) -> int:
        return len(self._step_starts()) - 1

    def labels(self) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """``(observed, accepted)`` masks ``[R, K]`` from the counts."""
        return labels(
            self.num_verified.astype(np.int64), self.num_accepted.astype(np.int64), self.k
        )

    def labelled_count(self) -> int:
        """Number of labelled drafts: ``sum(min(num_accepted + 1, num_verified))``."""
        d = self.num_verified.astype(np.int64)
        return int(np.minimum(self.num_accepted.astype(np.int64) + 1, d).sum())

    def accepted_count(self) -> int:
        """Number of accepted drafts: ``sum(num_accepted)``."""
        return int(self.num_accepted.astype(np.int64).sum())

    def strata(self) -> npt.NDArray[np.str_]:
        """Each row's stratum: the ``stratum`` array, or (a trace without one) the
        stratum of the meta's temperature for every row."""
        if self.stratum is not None:
            return self.stratum
        return np.full(self.rows, stratum_of(float(self.meta.get("temperature", 1.0))))

    def optional_arrays(self) -> dict[str, npt.NDArray[np.float32]]:
        """The optional arrays this trace has, by name."""
        out = {}
        for name in OPTIONAL_ARRAYS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    def rows_slice(self, start: int, stop: int) -> Trace:
        """Rows ``[start, stop)`` as a new trace sharing this one's arrays."""
        sl = slice(start, stop)
        extra = {name: a[sl] for name, a in self.optional_arrays().items()}
        return replace(
            self,
            features=self.features[sl],
            num_verified=self.num_verified[sl],
            num_accepted=self.num_accepted[sl],
            step=self.step[sl],
            request=self.request[sl],
            meta=dict(self.meta),
            stratum=None if self.stratum is None else self.stratum[sl],
            **extra,
        )

    def steps(self) -> Iterator[Trace]:
        """One trace per decode step (a batch), in order."""
        starts = self._step_starts()
        for i in range(len(starts) - 1):
            yield self.rows_slice(int(starts[i]), int(starts[i + 1]))

    def slice_steps(self, start: int | None = None, stop: int | None = None) -> Trace:
        """Decode steps ``[start, stop)`` counted in order (the i-th step of the
        trace, not the step value), with Python slice semantics."""
        starts = self._step_starts()
        lo, hi, _ = slice(start, stop).indices(len(starts) - 1)
        hi = max(lo, hi)
        return self.rows_slice(int(starts[lo]), int(starts[hi]))

    def head(self, fraction: float) -> Trace:
        """The first ``fraction`` (in [0, 1]) of the decode steps, rounded."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
        return self.slice_steps(0, round(fraction * self.num_steps))

    def _step_starts(self) -> npt.NDArray[np.intp]:
        """Row index where each step begins, then ``rows``."""
        change = np.flatnonzero(np.diff(self.step)) + 1
        if self.rows == 0:
            return np.zeros(1, dtype=np.intp)
        return np.concatenate(([0], change, [self.rows])).astype(np.intp)

    def arrays(self) -> dict[str, np.ndarray]:
        """The archive's arrays by name, ``meta`` as a 0-d JSON string."""
        out: dict[str, np.ndarray] = {
            "features": self.features,
            "num_verified": self.num_verified,
            "num_accepted": self.num_accepted,
            "step": self.step,
            "request": self.request,
            "meta": np.array(json.dumps(self.meta)),
        }
        out.update(self.optional_arrays())
        if self.stratum is not None:
            out[STRATUM_ARRAY] = self.stratum
        return out

    def validate(self) -> Trace:
        """Validate and return a copy with the format's dtypes; raises :class:`TraceError`."""
        arrays: dict[str, Any] = dict(self.optional_arrays())
        if self.stratum is not None:
            arrays[STRATUM_ARRAY] = self.stratum
        arrays.update(
            features=self.features,
            num_verified=self.num_verified,
            num_accepted=self.num_accepted,
            step=self.step,
            request=self.request,
        )
        try:
            meta_json = json.dumps(self.meta, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise TraceError("meta", f"is not JSON-serialisable: {exc}") from None
        arrays["meta"] = np.array(meta_json)
        return _from_arrays(arrays)


def _check_kind(name: str, a: np.ndarray, kinds: str, what: str) -> None:
    if a.dtype.kind not in kinds:
        raise TraceError(name, f"must have {what} dtype, got {a.dtype}")


def _parse_meta(raw: Any) -> dict[str, Any]:
    m = np.asarray(raw)
    if m.shape != () or m.dtype.kind not in "US":
        raise TraceError("meta", f"must be a 0-d string array, got dtype {m.dtype} shape {m.shape}")
    text = m.item()
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError("meta", f"is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise TraceError("meta", f"must be a JSON object, got {type(meta).__name__}")
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise TraceError("meta", f"missing keys {missing}")
    if meta["format"] != FORMAT:
        raise TraceError("meta", f"format must be {FORMAT!r}, got {meta['format']!r}")
    k = meta["num_speculative_tokens"]
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise TraceError("meta", f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    for key in ("temperature", "top_p"):
        v = meta[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise TraceError("meta", f"{key} must be a finite number >= 0, got {v!r}")
    for key in ("target", "draft", "method"):
        if not isinstance(meta[key], str):
            raise TraceError("meta", f"{key} must be a string, got {meta[key]!r}")
    return meta


def _from_arrays(arrays: Mapping[str, Any]) -> Trace:
    """Validate raw arrays (as loaded from an archive) and build a :class:`Trace`."""
    for name in REQUIRED_ARRAYS:
        if name not in arrays:
            raise TraceError(name, "missing")
    meta = _parse_meta(arrays["meta"])
    k = int(meta["num_speculative_tokens"])

    x = np.asarray(arrays["features"])
    _check_kind("features", x, "f", "a floating-point")
    if x.ndim != 2:
        raise TraceError("features", f"must be 2-D [R, K], got shape {list(x.shape)}")
    if x.shape[1] != k:
        raise TraceError("features", f"has K={x.shape[1]}, meta num_speculative_tokens={k}")
    rows = x.shape[0]
    if not np.isfinite(x).all():
        raise TraceError("features", "contains NaN or infinite values")
    if x.size and float(np.abs(x).max()) > MAX_LOG_ODDS:
        raise TraceError("features", f"values must lie in [-{MAX_LOG_ODDS:g}, {MAX_LOG_ODDS:g}]")

    ints: dict[str, np.ndarray] = {}
    for name in ("num_verified", "num_accepted", "step", "request"):
        a = np.asarray(arrays[name])
        _check_kind(name, a, "iu", "an integer")
        if a.shape != (rows,):
            raise TraceError(
                name, f"must have shape [{rows}] (rows of features), got {list(a.shape)}"
            )
        ints[name] = a.astype(np.int64)
    d, acc = ints["num_verified"], ints["num_accepted"]
    if rows and (d.min() < 0 or d.max() > k):
        raise TraceError("num_verified", f"must lie in [0, K={k}], got [{d.min()}, {d.max()}]")
    if rows and acc.min() < 0:
        raise TraceError("num_accepted", f"must be >= 0, got {acc.min()}")
    if np.any(acc > d):
        bad = int(np.flatnonzero(acc > d)[0])
        raise TraceError(
            "num_accepted",
            f"exceeds num_verified at row {bad} ({acc[bad]} > {d[bad]})",
        )
    step = ints["step"]
    if np.any(np.diff(step) < 0):
        bad = int(np.flatnonzero(np.diff(step) < 0)[0]) + 1
        raise TraceError("step", f"must be non-decreasing; decreases at row {bad}")
    request = ints["request"]
    if rows:
        pairs = np.unique(np.stack([step, request]), axis=1).shape[1]
        if pairs != rows:
            raise TraceError("request", "a request appears twice in one step")

    extra: dict[str, npt.NDArray[np.float32]] = {}
    for name in OPTIONAL_ARRAYS:
        if name not in arrays:
            continue
        a = np.asarray(arrays[name])
        _check_kind(name, a, "f", "a floating-point")
        if a.shape != x.shape:
            raise TraceError(
                name, f"must have shape {list(x.shape)} like features, got {list(a.shape)}"
            )
        if not np.isfinite(a).all():
            raise TraceError(name, "contains NaN or infinite values")
        if name in _PROBABILITY_ARRAYS and a.size and (a.min() < 0.0 or a.max() > 1.0):
            raise TraceError(name, "values must lie in [0, 1]")
        extra[name] = a.astype(np.float32)

    return Trace(
        stratum=_check_stratum(arrays.get(STRATUM_ARRAY), rows),
        features=x.astype(np.float32),
        num_verified=d.astype(np.int32),
        num_accepted=acc.astype(np.int32),
        step=step,
        request=request,
        meta=meta,
        **extra,
    )


def _check_stratum(raw: Any, rows: int) -> npt.NDArray[np.str_] | None:
    """The ``stratum`` array checked: a string per row, each a stratum name."""
    if raw is None:
        return None
    a = np.asarray(raw)
    _check_kind(STRATUM_ARRAY, a, "U", "a string (numpy unicode)")
    if a.shape != (rows,):
        raise TraceError(
            STRATUM_ARRAY, f"must have shape [{rows}] (rows of features), got {list(a.shape)}"
        )
    for name in np.unique(a):
        try:
            check_stratum(str(name))
        except InvalidInput as exc:
            raise TraceError(STRATUM_ARRAY, exc.problem) from None
    return a


#: What a file that is no avest trace is told (numpy's message would advise pickle).
NOT_A_TRACE = (
    "is not an avest trace (an avest-trace/1 .npz archive of numeric arrays, as "
    "`avest record` writes)"
)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Load and validate an ``avest-trace/1`` archive; raises :class:`TraceError`."""
    try:
        loaded = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        # numpy's own words would advise allow_pickle, which no trace needs.
        raise TraceError("file", NOT_A_TRACE, path) from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise TraceError("file", "is a single array, not an .npz archive", path)
    with loaded:
        arrays: dict[str, np.ndarray] = {}
        for name in loaded.files:
            if name not in (*REQUIRED_ARRAYS, *OPTIONAL_ARRAYS, STRATUM_ARRAY):
                continue  # unknown arrays are ignored, so later versions stay readable
            try:
                arrays[name] = loaded[name]
            except ValueError:
                raise TraceError(
                    name, f"holds pickled Python objects; {NOT_A_TRACE}", path
                ) from None
    try:
        return _from_arrays(arrays)
    except TraceError as exc:
        raise TraceError(exc.array, exc.problem, path) from None


def write_trace(path: str | os.PathLike[str], trace: Trace, *, compress: bool = True) -> Path:
    """Validate ``trace`` and write it to ``path`` (atomically); returns the path.

    The name is used as given (numpy would otherwise append ``.npz``).
    """
    checked = trace.validate()
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            arrays: dict[str, Any] = checked.arrays()
            (np.savez_compressed if compress else np.savez)(f, **arrays)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def bundled_sample_path() -> Path:
    """Path of the sample trace shipped in the package (a slice of the chat trace)."""
    ref = resources.files("avest").joinpath("data").joinpath(SAMPLE_NAME)
    if not isinstance(ref, Path):
        raise FileNotFoundError(
            f"avest is not installed from a directory; cannot locate {SAMPLE_NAME}"
        )
    if not ref.is_file():
        raise FileNotFoundError(f"bundled sample trace missing: {ref}")
    return ref
