"""Strata through a real server (docs/strata.md): a mixed stream of two strata gives
each stratum the coefficients the core's StratifiedEstimator computes from the same
steps, the pair's own stay what traffic without strata gets, round summaries name
their stratum, old-style messages carry none, a stratum past the bound falls back to
the pair's coefficients (counted), and a restart from the store keeps the strata."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import grpc
import numpy as np
import pytest

from avest.core.estimator import Batch
from avest_client.summary import RoundAccumulator
from avest_wire.messages import set_step_strata, summary_to_pb
from avest_wire.strata import MAX_STRATA
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import TOKEN, Live, observe, register
from tests.support.rpc import observe_request
from tests.support.strata import (
    INTERVAL,
    TRUTH,
    K,
    batch_of,
    core_strata,
    mixed_steps,
    strata_messages,
)


def _coefficients(live: Live, pair_id: str) -> pb.Coefficients:
    resp = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pair_id), timeout=10)
    return resp.coefficients


def _pairs_own(c: pb.Coefficients) -> tuple[float, list[float], int, int]:
    """The pair's own set with its version and round (its strata aside)."""
    return c.slope, list(c.intercepts), c.version, c.round


def _open(open_server: Callable[..., Live]) -> Live:
    # Every full round refits at once: the core's refits fall on the same steps.
    return open_server(min_refit_interval_ms=0)


def _register(live: Live) -> str:
    return register(live, k=K, refit_interval=INTERVAL, rule=pb.UPDATE_RULE_TRACKING)


def test_two_strata_equal_the_cores(open_server: Callable[..., Live]) -> None:
    live = _open(open_server)
    pair_id = _register(live)
    msgs = strata_messages(pair_id, mixed_steps(1, 60))
    assert observe(live, msgs) == len(msgs)
    want = core_strata(msgs)
    got = _coefficients(live, pair_id)
    # The pair's own set is the pooled estimator's, as without strata.
    assert got.slope == want.pooled.coefficients.slope
    assert tuple(got.intercepts) == want.pooled.coefficients.intercepts
    assert got.version == want.pooled.version and got.round == want.pooled.round
    assert [s.stratum for s in got.strata] == ["greedy", "t0.5-1"]
    for s in got.strata:
        c = want.coefficients_for(s.stratum)
        assert s.slope == c.slope and tuple(s.intercepts) == c.intercepts, s.stratum
        assert s.rounds == want.strata[s.stratum].rounds >= 6
        assert s.drafts == want.strata[s.stratum].drafts
    # The strata moved apart toward their truths: greedy's slope is the steeper.
    slopes = {s.stratum: s.slope for s in got.strata}
    assert slopes["greedy"] > slopes["t0.5-1"]
    # The admin API and GetPair say the same; ListPairs pages carry no strata.
    r = live.http.get(f"/v1/pairs/{pair_id}/strata").json()
    assert [(s["stratum"], s["slope"]) for s in r["strata"]] == [
        (s.stratum, s.slope) for s in got.strata
    ]
    assert r["fallback_rows"] == 0 and r["max_strata"] == MAX_STRATA
    # Each stratum's calibration: its rows scored at what it served (predict, then
    # learn), as the core measures them.
    for s in r["strata"]:
        cal = want.strata[s["stratum"]].calibration
        assert cal is not None
        assert s["calibration"]["count"] == cal.count == s["drafts"]
        assert s["calibration"]["ece"] == pytest.approx(cal.summary().ece, abs=1e-12)
        assert s["calibration"]["logloss"] == pytest.approx(cal.summary().logloss, abs=1e-12)
    pair = live.stub.GetPair(pb.GetPairRequest(pair_id=pair_id), timeout=10).pair
    assert list(pair.coefficients.strata) == list(got.strata)
    # The metrics: each stratum's slope and calibration under a stratum label.
    text = live.http.get("/metrics").text
    for s in r["strata"]:
        labels = f'{{pair="{pair_id}",stratum="{s["stratum"]}"}}'
        assert f"avest_stratum_slope{labels} {s['slope']!r}" in text
        ece = float(text.split(f"avest_stratum_ece{labels} ")[1].split()[0])
        assert ece == pytest.approx(s["calibration"]["ece"], abs=1e-12)
    listed = live.stub.ListPairs(pb.ListPairsRequest(), timeout=10).pairs
    assert [p.pair_id for p in listed] == [pair_id] and not listed[0].coefficients.strata


def test_traffic_without_strata_is_todays(open_server: Callable[..., Live]) -> None:
    """The same steps with and without strata: the pair's own coefficients agree bit
    for bit, and old-style messages (no strata fields) leave the pair without strata."""
    live = _open(open_server)
    plain = _register(live)
    mixed = register(
        live, k=K, refit_interval=INTERVAL, rule=pb.UPDATE_RULE_TRACKING, workload="mixed"
    )
    steps = mixed_steps(2, 40)
    assert observe(live, strata_messages(plain, steps, strata=False)) == 40
    assert observe(live, strata_messages(mixed, steps)) == 40
    a, b = _coefficients(live, plain), _coefficients(live, mixed)
    assert _pairs_own(a) == _pairs_own(b)
    assert not a.strata and len(b.strata) == 2
    assert live.http.get(f"/v1/pairs/{plain}/strata").json()["strata"] == []


def test_round_summaries_name_their_stratum(open_server: Callable[..., Live]) -> None:
    """A summary per stratum (the round's steps split between them) feeds that
    stratum's fit and the pair's pooled round."""
    live = _open(open_server)
    pair_id = _register(live)
    start = _coefficients(live, pair_id)
    steps = mixed_steps(3, 20)
    msgs = []
    for lo in range(0, 20, 5):
        for j, name in enumerate(TRUTH):
            acc = RoundAccumulator(K)
            for x, verified, accepted, names in steps[lo : lo + 5]:
                rows = [r for r, n in enumerate(names) if n == name]
                acc.add(
                    x[rows],
                    np.asarray(verified)[rows],
                    np.asarray(accepted)[rows],
                    start.slope,
                    list(start.intercepts),
                )
            summary = acc.take(start.version, start.slope, list(start.intercepts))
            assert summary is not None
            msg = summary_to_pb(dataclasses.replace(summary, steps=2 + j))
            msg.stratum = name
            msgs.append(
                pb.ObserveRequest(
                    pair_id=pair_id, worker_id="w0", sequence=len(msgs) + 1, summary=msg
                )
            )
    assert observe(live, msgs) == len(msgs)
    # The same summaries without their stratum, to a pair of their own: the pair's
    # coefficients, version and round are the same (it pools as without strata).
    plain = register(
        live, k=K, refit_interval=INTERVAL, rule=pb.UPDATE_RULE_TRACKING, workload="plain"
    )
    bare = []
    for m in msgs:
        c = pb.ObserveRequest()
        c.CopyFrom(m)
        c.pair_id = plain
        c.summary.stratum = ""
        bare.append(c)
    assert observe(live, bare) == len(bare)
    got, want = _coefficients(live, pair_id), _coefficients(live, plain)
    assert _pairs_own(got) == _pairs_own(want)
    assert not want.strata
    assert [s.stratum for s in got.strata] == ["greedy", "t0.5-1"]
    assert all(s.drafts > 0 and s.rounds >= 1 for s in got.strata)
    # Each stratum's calibration comes from its summaries' sketches.
    for s in live.http.get(f"/v1/pairs/{pair_id}/strata").json()["strata"]:
        assert s["calibration"]["count"] == s["drafts"] > 0
        assert 0.0 < s["calibration"]["logloss"] < 2.0
    slopes = {s.stratum: s.slope for s in got.strata}
    assert slopes["greedy"] != slopes["t0.5-1"]


def test_bad_strata_are_refused_at_the_edge(open_server: Callable[..., Live]) -> None:
    live = _open(open_server)
    pair_id = _register(live)
    (req,) = strata_messages(pair_id, mixed_steps(4, 1))
    req.stratum_index[0] = 7
    with pytest.raises(grpc.RpcError) as info:
        observe(live, [req])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stratum_index" in info.value.details()
    assert not _coefficients(live, pair_id).strata


def test_past_max_strata_falls_back_counted(open_server: Callable[..., Live]) -> None:
    live = _open(open_server)
    pair_id = _register(live)
    x, verified, accepted, _ = mixed_steps(5, 1, rows=MAX_STRATA)[0]
    first = observe_request(pair_id, "w0", 1, x, verified, accepted)
    set_step_strata(first, [f"label{i}/greedy" for i in range(MAX_STRATA)])
    second = observe_request(pair_id, "w0", 2, x[:2], verified[:2], accepted[:2])
    set_step_strata(second, ["label0/greedy", "extra/greedy"])
    assert observe(live, [first, second]) == 2
    r = live.http.get(f"/v1/pairs/{pair_id}/strata").json()
    assert len(r["strata"]) == MAX_STRATA
    assert "extra/greedy" not in {s["stratum"] for s in r["strata"]}
    assert r["fallback_rows"] == 1
    assert r["fallback_drafts"] == min(accepted[1] + 1, K)
    # The metrics: a series per stratum held (bounded), the fallback counted.
    text = live.http.get("/metrics").text
    slopes = [ln for ln in text.splitlines() if ln.startswith("avest_stratum_slope{")]
    assert len(slopes) == MAX_STRATA and not any("extra/greedy" in ln for ln in slopes)
    assert f'avest_strata_fallback_rows_total{{pair="{pair_id}"}} 1.0' in text


def test_a_restart_keeps_the_strata(open_server: Callable[..., Live]) -> None:
    live = _open(open_server)
    pair_id = _register(live)
    msgs = strata_messages(pair_id, mixed_steps(6, 35))
    assert observe(live, msgs) == len(msgs)
    before = _coefficients(live, pair_id)
    assert len(before.strata) == 2
    live.stop()
    again = _open(open_server)
    after = _coefficients(again, pair_id)
    assert list(after.strata) == list(before.strata)
    # The open round and each stratum's rule state came back too: the rest of the
    # stream gives what one uninterrupted run gives.
    more = strata_messages(pair_id, mixed_steps(7, 25), first=len(msgs) + 1)
    assert observe(again, more) == len(msgs) + len(more)
    want = core_strata(msgs + more)
    got = _coefficients(again, pair_id)
    for s in got.strata:
        c = want.coefficients_for(s.stratum)
        assert s.slope == c.slope and tuple(s.intercepts) == c.intercepts, s.stratum


def test_the_pending_log_keeps_a_rows_strata() -> None:
    """Replicas: a step's strata and a summary's stratum survive the pending log
    (:func:`avest.state.replicas.encode` and ``decode_stratified``); a row without
    strata reads back without."""
    from avest.state.replicas import decode_stratified, encode

    (req,) = strata_messages("p", mixed_steps(8, 1))
    batch = batch_of(req)
    names = tuple(req.strata[i] for i in req.stratum_index)
    got, strata = decode_stratified(*encode(batch, None, names), K)
    assert strata == names and isinstance(got, Batch)
    assert np.array_equal(got.features, batch.features)
    assert decode_stratified(*encode(batch), K)[1] is None
    acc = RoundAccumulator(K)
    x, verified, accepted, _ = mixed_steps(9, 1)[0]
    acc.add(x, verified, accepted, 0.5, [-0.2] * K)
    summary = acc.take(0, 0.5, [-0.2] * K)
    assert summary is not None
    assert decode_stratified(*encode(summary, None, "greedy"), K)[1] == "greedy"
    msg = summary_to_pb(summary)
    msg.stratum = "t>=1"
    assert decode_stratified(*encode(summary, msg, "t>=1"), K)[1] == "t>=1"
    assert decode_stratified(*encode(summary), K)[1] is None


def test_a_reset_forgets_the_strata_and_a_delete_their_series(
    open_server: Callable[..., Live],
) -> None:
    live = _open(open_server)
    pair_id = _register(live)
    msgs = strata_messages(pair_id, mixed_steps(10, 20))
    assert observe(live, msgs) == len(msgs)
    assert len(_coefficients(live, pair_id).strata) == 2
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert live.http.post(f"/v1/pairs/{pair_id}/reset", headers=auth).status_code == 200
    assert not _coefficients(live, pair_id).strata
    assert live.http.get(f"/v1/pairs/{pair_id}/strata").json()["strata"] == []
    more = strata_messages(pair_id, mixed_steps(11, 20), first=len(msgs) + 1)
    assert observe(live, more) == len(msgs) + len(more)
    assert "avest_stratum_slope{" in live.http.get("/metrics").text
    assert live.http.delete(f"/v1/pairs/{pair_id}", headers=auth).status_code == 200
    assert "avest_stratum_slope{" not in live.http.get("/metrics").text
