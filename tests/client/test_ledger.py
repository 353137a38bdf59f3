"""The forwarders' delivery bookkeeping on its own (no I/O)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from avest_client._stream import Backoff, refused_sequence
from avest_client.ledger import Ledger


def held(ledger: Ledger) -> list[int]:
    inflight, queued = ledger.sequences()
    return inflight + queued


def send(ledger: Ledger, n: int) -> list[int]:
    out = []
    for _ in range(n):
        step = ledger.next_to_send()
        assert step is not None
        out.append(step.sequence)
    return out


def test_sequences_start_at_one_and_increase():
    ledger = Ledger(queue_size=10)
    assert [ledger.submit(i) for i in range(3)] == [1, 2, 3]
    assert ledger.stats().last_sequence == 3
    step = ledger.next_to_send()
    assert (step.sequence, step.payload, step.attempts) == (1, 0, 1)


def test_a_watermark_releases_steps_queued_after_it_came():
    """A rerun under the same worker id: the service acknowledges its first resent
    step with the watermark it already held, then each later duplicate with the same."""
    ledger = Ledger(queue_size=10)
    ledger.submit(0)
    send(ledger, 1)
    assert ledger.ack(5) == 1
    for i in range(3):
        ledger.submit(i)
    send(ledger, 3)
    assert ledger.ack(5) == 3 and held(ledger) == []
    assert ledger.stats().acked == 4


def test_a_full_queue_drops_the_oldest_unsent_step_exactly():
    ledger = Ledger(queue_size=3)
    for i in range(10):
        ledger.submit(i)
    s = ledger.stats()
    assert (s.submitted, s.dropped, s.pending) == (10, 7, 3)
    assert held(ledger) == [8, 9, 10]
    # Sent steps do not count against the queue bound.
    assert send(ledger, 2) == [8, 9]
    for i in range(2):
        ledger.submit(i)
    assert ledger.sequences() == ([8, 9], [10, 11, 12])
    ledger.submit(0)
    assert ledger.sequences() == ([8, 9], [11, 12, 13]) and ledger.stats().dropped == 8


def test_acks_release_steps_and_the_watermark_never_decreases():
    ledger = Ledger(queue_size=10)
    for i in range(6):
        ledger.submit(i)
    send(ledger, 4)
    assert ledger.ack(2) == 2
    assert ledger.sequences() == ([3, 4], [5, 6])
    assert ledger.ack(1) == 0 and ledger.watermark == 2
    # A watermark may cover steps not yet (re)sent on this stream: they are done.
    assert ledger.ack(5) == 3
    assert ledger.sequences() == ([], [6])
    s = ledger.stats()
    assert (s.acked, s.acked_sequence, s.pending, s.sent) == (5, 5, 1, 4)


def test_rewind_resends_unacknowledged_steps_in_order_before_new_ones():
    ledger = Ledger(queue_size=10)
    for i in range(5):
        ledger.submit(i)
    send(ledger, 3)
    ledger.ack(1)
    assert ledger.rewind() == 2
    ledger.submit(5)
    assert send(ledger, 5) == [2, 3, 4, 5, 6]
    s = ledger.stats()
    assert (s.sent, s.resent) == (8, 2)


def test_rewind_keeps_the_queue_bound_dropping_the_oldest():
    ledger = Ledger(queue_size=4, max_unacked=10)
    for i in range(4):
        ledger.submit(i)
    send(ledger, 4)
    for i in range(3):
        ledger.submit(i)
    ledger.rewind()
    assert ledger.sequences() == ([], [4, 5, 6, 7])
    assert ledger.stats().dropped == 3


def test_the_in_flight_window_is_bounded_too():
    ledger = Ledger(queue_size=100, max_unacked=3)
    for i in range(10):
        ledger.submit(i)
    send(ledger, 10)
    assert ledger.sequences() == ([8, 9, 10], [])
    s = ledger.stats()
    assert (s.dropped, s.sent, s.pending) == (7, 10, 3)


def test_a_refused_step_is_discarded_and_never_resent():
    ledger = Ledger(queue_size=10)
    for i in range(5):
        ledger.submit(i)
    send(ledger, 4)
    assert ledger.refuse(3)
    assert not ledger.refuse(3)
    assert not ledger.refuse(99)
    ledger.rewind()
    assert send(ledger, 4) == [1, 2, 4, 5]
    # Without a sequence (unparsable refusal) the oldest held step goes: progress is certain.
    assert ledger.refuse(None)
    assert held(ledger) == [2, 4, 5]
    assert ledger.stats().refused == 2


def test_refusal_messages_name_the_sequence():
    assert refused_sequence("sequence 17 of worker 'h:1:ab': k: is 6, the pair has K=5") == 17
    assert refused_sequence("unknown pair_id 'x'") is None
    assert refused_sequence(None) is None


def test_backoff_is_capped_and_jittered():
    b = Backoff(initial_s=0.1, max_s=1.0, multiplier=2.0)
    delays = [b.delay(n) for n in range(12)]
    assert all(0.05 <= d <= 1.0 for d in delays)
    assert max(delays[6:]) <= 1.0 and min(delays[6:]) >= 0.5
    assert 0.05 <= b.delay(0) <= 0.1
    assert b.delay(10_000) <= 1.0


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        Ledger(queue_size=0)
    with pytest.raises(ValueError):
        Ledger(queue_size=1, max_unacked=0)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.integers(1, 5)),
        st.tuples(st.just("send"), st.integers(1, 5)),
        st.tuples(st.just("ack"), st.integers(0, 40)),
        st.tuples(st.just("rewind"), st.just(0)),
        st.tuples(st.just("refuse"), st.integers(0, 40)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, queue_size=st.integers(1, 6), max_unacked=st.integers(1, 6))
def test_counters_stay_exact_under_any_sequence_of_events(ops, queue_size, max_unacked):
    ledger = Ledger(queue_size, max_unacked)
    acked_seen: set[int] = set()
    for op, n in ops:
        if op == "submit":
            for _ in range(n):
                ledger.submit(None)
        elif op == "send":
            for _ in range(n):
                step = ledger.next_to_send()
                if step is not None:
                    assert step.sequence not in acked_seen
        elif op == "ack":
            ledger.ack(min(n, ledger.stats().last_sequence))  # the server acks only what it saw
            acked_seen.update(range(1, ledger.watermark + 1))
        elif op == "rewind":
            ledger.rewind()
        else:
            ledger.refuse(n or None)
        s = ledger.stats()
        inflight, queued = ledger.sequences()
        seqs = inflight + queued
        # Exact accounting, strict order, bounds, nothing acknowledged is held.
        assert s.submitted == s.acked + s.dropped + s.refused + s.pending
        assert s.pending == len(seqs)
        assert seqs == sorted(set(seqs))
        assert all(q > s.acked_sequence for q in seqs)
        assert len(queued) <= queue_size
        assert len(inflight) <= max_unacked
        assert s.resent <= s.sent
