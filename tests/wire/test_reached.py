"""A round summary's reached counts: the features of every draft that reached its position,
verified or trimmed by adaptive verification (``RoundSummary.reached``), the draft-length
schedule's input. Built on the host, carried on the wire, checked once at the edge."""

from __future__ import annotations

import numpy as np
import pytest

from avest_client.summary import RoundAccumulator
from avest_wire.bins import FEATURE_BINS
from avest_wire.errors import InvalidInput
from avest_wire.limits import MAX_STEP_REQUESTS
from avest_wire.messages import summary_from_checked_pb, summary_from_pb, summary_to_pb
from avest_wire.summary import RoundSummary
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.steps import reached_by_brute_force, trimmed_steps

K = 4


def build(steps: list[tuple[np.ndarray, ...]], k: int = K) -> RoundSummary:
    acc = RoundAccumulator(k, reached=True)
    for x, d, a in steps:
        acc.add(x, d, a, 0.5, [-0.2] * k)
    s = acc.take(3, 0.5, [-0.2] * k)
    assert s is not None and s.reached is not None
    return s


def test_the_host_counts_every_draft_that_reached_its_position() -> None:
    steps = trimmed_steps(12, 40, K, seed=1)
    s = build(steps)
    assert s.reached is not None
    got = s.reached.dense()
    np.testing.assert_array_equal(got, reached_by_brute_force(steps, K))
    per = got.sum(axis=1)
    # trimmed drafts are counted: more reached than labelled at every position here
    assert (per >= s.counts).all() and (per > s.counts).any()
    assert (per[1:] <= s.counts[:-1]).all()


def test_reached_counts_cross_the_wire_and_replicas_read_them_unchecked() -> None:
    s = build(trimmed_steps(5, 30, K, seed=2))
    msg = summary_to_pb(s)
    assert msg.HasField("reached")
    for got in (summary_from_pb(msg, K), summary_from_checked_pb(msg, K)):
        assert got.reached is not None and s.reached is not None
        np.testing.assert_array_equal(got.reached.cells, s.reached.cells)
        np.testing.assert_array_equal(got.reached.counts, s.reached.counts)
        np.testing.assert_array_equal(got.counts, s.counts)
    bare = pb.RoundSummary()
    bare.CopyFrom(msg)
    bare.ClearField("reached")
    assert summary_from_pb(bare, K).reached is None  # optional: a worker may not send it


def _tampered(change: str) -> pb.RoundSummary:
    s = build(trimmed_steps(5, 30, K, seed=3))
    msg = summary_to_pb(s)
    r = msg.reached
    deltas, counts = list(r.cell_deltas), list(r.cell_counts)
    n = s.counts
    if change == "a gap of 0":
        deltas[2] = 0
    elif change == "a cell past the last position":
        deltas.append(K * FEATURE_BINS)
        counts.append(1)
    elif change == "a count of 0":
        counts[0] = 0
    elif change == "fewer than labelled":
        counts = [1] * len(counts)
    elif change == "more at position 1 than labelled at 0":
        # the first cell of position 1 takes more than every draft labelled at position 0
        cells = np.cumsum(deltas)
        at = int(np.argmax(cells >= FEATURE_BINS))
        counts[at] += int(n[0]) + 1
    elif change == "more requests than a step can hold":
        counts[0] += 5 * MAX_STEP_REQUESTS
    del r.cell_deltas[:]
    del r.cell_counts[:]
    r.cell_deltas.extend(deltas)
    r.cell_counts.extend(counts)
    return msg


@pytest.mark.parametrize(
    ("change", "field", "says"),
    [
        ("a gap of 0", "cell_deltas", "gaps after the first cell must be >= 1"),
        ("a cell past the last position", "cell_deltas", f"[0, {K * FEATURE_BINS})"),
        ("a count of 0", "cell_counts", "must be >= 1"),
        ("fewer than labelled", "cell_counts", "fewer than the"),
        ("more at position 1 than labelled at 0", "cell_counts", "only its accepted drafts"),
        ("more requests than a step can hold", "cell_counts", f"more than {MAX_STEP_REQUESTS}"),
    ],
)
def test_reached_counts_no_round_produces_are_refused(change: str, field: str, says: str) -> None:
    with pytest.raises(InvalidInput) as exc:
        summary_from_pb(_tampered(change), K)
    assert exc.value.field == f"summary.reached.{field}"
    assert says in exc.value.problem
