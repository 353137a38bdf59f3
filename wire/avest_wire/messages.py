"""Round summaries to and from their messages (``avest.v1.RoundSummary``), and the
strata a message names (``ObserveRequest.strata``, ``RoundSummary.stratum``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from avest_wire.bins import ECE_BINS
from avest_wire.errors import InvalidInput
from avest_wire.strata import MAX_STRATA, check_stratum
from avest_wire.summary import (
    Reached,
    RoundSummary,
    Sketch,
    build_summary,
    intake,
    intake_reached,
    make_reached,
    make_sketch,
    make_summary,
)
from avest_wire.v1 import estimator_pb2 as pb


def _deltas(cells: np.ndarray) -> list[int]:
    """Ascending cells as the wire lists them: the first, then each gap."""
    return (np.diff(cells, prepend=0) if cells.size else cells).tolist()


def sketch_to_pb(sketch: Sketch) -> pb.CalibrationSketch:
    ece = sketch.ece
    return pb.CalibrationSketch(
        cell_deltas=_deltas(sketch.cells),
        cell_counts=sketch.counts.astype(np.int64).tolist(),
        ece_rejected=ece[:, :, 0].astype(np.int64).reshape(-1).tolist(),
        ece_accepted=ece[:, :, 1].astype(np.int64).reshape(-1).tolist(),
        ece_sum_predicted=sketch.psum.reshape(-1).tolist(),
        logloss_sum=sketch.nll.tolist(),
    )


def reached_to_pb(reached: Reached) -> pb.ReachedCounts:
    return pb.ReachedCounts(
        cell_deltas=_deltas(reached.cells), cell_counts=reached.counts.astype(np.int64).tolist()
    )


def summary_to_pb(summary: RoundSummary) -> pb.RoundSummary:
    return pb.RoundSummary(
        coefficients_version=int(summary.version),
        slope=float(summary.slope),
        intercepts=list(summary.intercepts),
        k=summary.k,
        info=summary.info.reshape(-1).tolist(),
        grad=summary.grad.reshape(-1).tolist(),
        counts=summary.counts.tolist(),
        steps=int(summary.steps),
        drafts=int(summary.drafts),
        sketch=sketch_to_pb(summary.sketch) if summary.sketch is not None else None,
        reached=reached_to_pb(summary.reached) if summary.reached is not None else None,
    )


def step_strata(req: pb.ObserveRequest) -> tuple[str, ...] | None:
    """Each row's stratum of a decode step, or None for a step without strata (every
    row the pair's pooled traffic). Checked: at most :data:`MAX_STRATA` distinct valid
    names, one index per row below their number; :class:`InvalidInput` names the field."""
    names, index = req.strata, req.stratum_index
    if not names:
        if index:
            raise InvalidInput("stratum_index", "must be empty when strata is")
        return None
    if len(names) > MAX_STRATA:
        raise InvalidInput("strata", f"has {len(names)} names, at most {MAX_STRATA}")
    for name in names:
        try:
            check_stratum(name)
        except InvalidInput as exc:
            raise InvalidInput("strata", exc.problem) from None
    if len(set(names)) != len(names):
        raise InvalidInput("strata", "names a stratum twice")
    if len(index) != req.rows:
        raise InvalidInput("stratum_index", f"has {len(index)} entries, rows={req.rows}")
    rows = np.asarray(index, dtype=np.int64)
    if rows.size and int(rows.max()) >= len(names):
        raise InvalidInput("stratum_index", f"must be below the {len(names)} strata named")
    table = tuple(names)
    return tuple(table[i] for i in rows.tolist())


def set_step_strata(req: pb.ObserveRequest, strata: tuple[str, ...] | list[str]) -> None:
    """Write each row's stratum into a step message: the distinct names in order of
    first appearance and an index per row (what :func:`step_strata` reads back)."""
    table: dict[str, int] = {}
    index = [table.setdefault(s, len(table)) for s in strata]
    del req.strata[:]
    del req.stratum_index[:]
    req.strata.extend(table)
    req.stratum_index.extend(index)


def summary_stratum(s: pb.RoundSummary) -> str | None:
    """The stratum a round summary sums (None: the worker's whole round); checked,
    :class:`InvalidInput` naming ``summary.stratum``."""
    if not s.stratum:
        return None
    try:
        return check_stratum(s.stratum)
    except InvalidInput as exc:
        raise InvalidInput("summary.stratum", exc.problem) from None


def summary_from_pb(s: pb.RoundSummary, k: int) -> RoundSummary:
    """The summary a message carries for a pair of ``k`` positions.

    :class:`InvalidInput` names the field (``summary.*`` or ``sketch.*``).
    The fast path (:func:`~avest_wire.summary.intake`) takes a valid message;
    anything it refuses goes through the thorough checks, which name the field.
    """
    if s.k != k:
        raise InvalidInput("summary.k", f"is {s.k}, the pair has K={k}")
    with_sketch = _with_sketch(s)
    summary = intake_pb(s, k, with_sketch)
    if summary is None:
        summary = _checked(s, k, with_sketch)
    if not s.HasField("reached"):
        return summary
    r = s.reached
    reached = intake_reached(k, r.cell_deltas, r.cell_counts, summary.counts, summary.steps)
    if reached is None:  # the thorough checks, which name what fails
        deltas = np.asarray(r.cell_deltas, dtype=np.int64)
        try:
            if deltas.size > 1 and deltas[1:].min() < 1:
                raise InvalidInput("cell_deltas", "gaps after the first cell must be >= 1")
            reached = make_reached(
                k, deltas.cumsum(), r.cell_counts, labelled=summary.counts, steps=summary.steps
            )
        except InvalidInput as exc:
            raise InvalidInput(f"summary.reached.{exc.field}", exc.problem) from None
    return dataclasses.replace(summary, reached=reached)


def summary_from_checked_pb(s: pb.RoundSummary, k: int) -> RoundSummary:
    """A summary this process or another replica already checked with
    :func:`summary_from_pb` (its message stored as received, in a replicas' pending
    log), read without checking it again: a summary is checked once, at the edge."""
    every = np.concatenate(
        [np.asarray(v, dtype=np.float64) for v in (s.intercepts, s.info, s.grad, s.counts)]
    )
    sketch = None
    if _with_sketch(s):
        sk = s.sketch
        ece = np.concatenate(
            [np.asarray(sk.ece_rejected, dtype=np.float64), np.asarray(sk.ece_accepted)]
        ).reshape(2, k, ECE_BINS)
        sketch = Sketch(
            k,
            np.asarray(sk.cell_deltas, dtype=np.int64).cumsum(),
            np.asarray(sk.cell_counts, dtype=np.float64),
            ece.transpose(1, 2, 0).copy(),
            np.asarray(sk.ece_sum_predicted, dtype=np.float64).reshape(k, ECE_BINS),
            np.asarray(sk.logloss_sum, dtype=np.float64),
        )
    drafts = int(every[6 * k :].sum())
    out = build_summary(k, s.coefficients_version, float(s.slope), every, s.steps, drafts, sketch)
    if not s.HasField("reached"):
        return out
    cells = np.asarray(s.reached.cell_deltas, dtype=np.int64).cumsum()
    reached = Reached(k, cells, np.asarray(s.reached.cell_counts, dtype=np.float64))
    return dataclasses.replace(out, reached=reached)


def _with_sketch(s: pb.RoundSummary) -> bool:
    sk = s.sketch
    return s.HasField("sketch") and bool(len(sk.cell_deltas) or len(sk.logloss_sum))


#: The fields of a RoundSummary message that :func:`intake` takes under the same names.
_INTAKE_FIELDS = ("slope", "intercepts", "info", "grad", "counts", "steps", "drafts")


def intake_pb(s: pb.RoundSummary, k: int, with_sketch: bool | None = None) -> RoundSummary | None:
    """The fast path (:func:`~avest_wire.summary.intake`) on a message for a pair of
    ``k`` positions: the summary, or None when any check fails (the thorough path
    then says which). ``with_sketch``: whether the message carries one (read from
    it when not given)."""
    if with_sketch is None:
        with_sketch = _with_sketch(s)
    sk = s.sketch
    parts = (
        (
            sk.cell_deltas,
            sk.cell_counts,
            sk.ece_rejected,
            sk.ece_accepted,
            sk.ece_sum_predicted,
            sk.logloss_sum,
        )
        if with_sketch
        else None
    )
    same_names = {name: getattr(s, name) for name in _INTAKE_FIELDS}
    return intake(k, version=s.coefficients_version, sketch=parts, **same_names)


def _checked(s: pb.RoundSummary, k: int, with_sketch: bool) -> RoundSummary:
    """The thorough path: every check in turn, naming the field that fails."""
    sketch = None
    sk = s.sketch
    if with_sketch:
        deltas = np.asarray(sk.cell_deltas, dtype=np.int64)
        if deltas.size > 1 and deltas[1:].min() < 1:
            raise InvalidInput("sketch.cell_deltas", "gaps after the first cell must be >= 1")
        # the other repeated fields go to numpy as they are (one conversion each)
        try:
            sketch = make_sketch(
                k,
                deltas.cumsum(),
                sk.cell_counts,
                sk.ece_rejected,
                sk.ece_accepted,
                sk.ece_sum_predicted,
                sk.logloss_sum,
            )
        except InvalidInput as exc:
            raise InvalidInput(f"sketch.{exc.field}", exc.problem) from None
    try:
        return make_summary(
            k,
            version=int(s.coefficients_version),
            slope=float(s.slope),
            intercepts=s.intercepts,
            info=s.info,
            grad=s.grad,
            counts=s.counts,
            steps=int(s.steps),
            drafts=int(s.drafts),
            sketch=sketch,
        )
    except InvalidInput as exc:
        field = exc.field if exc.field.startswith("sketch") else f"summary.{exc.field}"
        raise InvalidInput(field, exc.problem) from None
