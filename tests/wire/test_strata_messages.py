"""Strata on the wire: a step's per-row strata (a table of names and an index per
row) and a round summary's stratum, read and checked once."""

from __future__ import annotations

import pytest

from avest_wire.errors import InvalidInput
from avest_wire.messages import set_step_strata, step_strata, summary_stratum
from avest_wire.strata import MAX_STRATA
from avest_wire.v1 import estimator_pb2 as pb


def _step(rows: int) -> pb.ObserveRequest:
    return pb.ObserveRequest(pair_id="p", worker_id="w", sequence=1, rows=rows, k=2)


def test_a_step_without_strata_is_the_pairs_traffic():
    assert step_strata(_step(3)) is None


def test_round_trip_of_row_strata():
    rows = ("greedy", "t0.5-1", "greedy", "code/greedy", "t0.5-1")
    req = _step(len(rows))
    set_step_strata(req, rows)
    assert list(req.strata) == ["greedy", "t0.5-1", "code/greedy"]
    assert list(req.stratum_index) == [0, 1, 0, 2, 1]
    again = pb.ObserveRequest.FromString(req.SerializeToString())
    assert step_strata(again) == rows


def test_the_index_costs_a_byte_a_row():
    """256 rows in two strata: the names once, a packed byte per row."""
    req = _step(256)
    set_step_strata(req, ["greedy", "t0.5-1"] * 128)
    bare = _step(256).ByteSize()
    assert req.ByteSize() - bare < 256 + 2 * 16 + 8


@pytest.mark.parametrize(
    ("names", "index", "rows", "field"),
    [
        ([], [0], 1, "stratum_index"),
        (["a"], [0, 0], 1, "stratum_index"),
        (["a"], [], 1, "stratum_index"),
        (["a", "b"], [2], 1, "stratum_index"),
        (["a", "a"], [0], 1, "strata"),
        ([""], [0], 1, "strata"),
        (["x" * 65], [0], 1, "strata"),
        (["a\nb"], [0], 1, "strata"),
        ([f"s{i}" for i in range(MAX_STRATA + 1)], [0], 1, "strata"),
    ],
)
def test_bad_strata_are_refused_naming_the_field(names, index, rows, field):
    req = _step(rows)
    req.strata.extend(names)
    req.stratum_index.extend(index)
    with pytest.raises(InvalidInput) as info:
        step_strata(req)
    assert info.value.field == field


def test_max_strata_names_are_taken():
    names = [f"s{i}" for i in range(MAX_STRATA)]
    req = _step(MAX_STRATA)
    set_step_strata(req, names)
    assert step_strata(req) == tuple(names)


def test_summary_stratum():
    assert summary_stratum(pb.RoundSummary()) is None
    assert summary_stratum(pb.RoundSummary(stratum="greedy")) == "greedy"
    for bad in ("x" * 65, "a\tb"):
        with pytest.raises(InvalidInput) as info:
            summary_stratum(pb.RoundSummary(stratum=bad))
        assert info.value.field == "summary.stratum"
