"""Summary mode against a real server: W workers' round summaries give what their raw
steps give (coefficients, calibration); summaries share the ledger with raw steps;
malformed summaries are refused and change nothing; the per-pair worker table."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from avest_client import EstimatorClient
from avest_client.summary import RoundAccumulator
from avest_wire.messages import summary_to_pb
from tests.support.helpers import wait_until

TARGET, DRAFT, METHOD = "target/model", "draft/model", "draft_model"
WORKERS, PER_WORKER = 4, 10


def _rounds(steps, rounds):
    """Round r, worker w: the steps the worker sends in that round."""
    per_round = WORKERS * PER_WORKER
    out = []
    for r in range(rounds):
        chunk = steps[r * per_round : (r + 1) * per_round]
        out.append([chunk[w * PER_WORKER : (w + 1) * PER_WORKER] for w in range(WORKERS)])
    return out


def _wait_version(client, pair_id, above):
    ok = wait_until(lambda: client.coefficients(pair_id).version > above, timeout=20)
    assert ok, f"pair did not refit past version {above}"
    return client.coefficients(pair_id)


def _run(server, k, rounds, rule, mode, labels):
    """Replay ``rounds`` as WORKERS workers in ``mode``; the pair's final info."""
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register(
            TARGET, DRAFT, METHOD, k, labels, rule=rule, refit_interval=WORKERS * PER_WORKER
        )
        fwds = [client.forwarder(reg.pair_id, f"w{w}", k=k) for w in range(WORKERS)]
        coef = reg.coefficients
        for shards in rounds:
            for fwd, shard in zip(fwds, shards, strict=True):
                if mode == "raw":
                    for x, d, a in shard:
                        fwd.submit(x, d, a, None)
                else:
                    acc = RoundAccumulator(k)
                    for x, d, a in shard:
                        acc.add(x, d, a, coef.slope, coef.intercepts)
                    summary = acc.take(coef.version, coef.slope, coef.intercepts)
                    assert summary is not None
                    fwd.submit_summary(summary)
            # every worker waits for the pooled refit before its next round
            coef = _wait_version(client, reg.pair_id, coef.version)
        for fwd in fwds:
            assert fwd.flush(20)
            assert fwd.stats.refused == 0 and fwd.stats.invalid == 0
        return client.pair(reg.pair_id), [f.stats for f in fwds]


@pytest.mark.parametrize("rule", ["vllm", "recursive"])
def test_w_workers_in_summary_mode_give_the_raw_coefficients_and_calibration(
    server, chat_steps, rule
):
    rounds = 5
    k, steps = chat_steps(0, WORKERS * PER_WORKER * rounds)
    split = _rounds(steps, rounds)
    raw, raw_stats = _run(server, k, split, rule, "raw", {"mode": "raw"})
    summ, summ_stats = _run(server, k, split, rule, "summary", {"mode": "summary"})
    assert raw.coefficients.version == summ.coefficients.version
    assert raw.steps_observed == summ.steps_observed == WORKERS * PER_WORKER * rounds
    assert raw.drafts_observed == summ.drafts_observed > 0
    np.testing.assert_allclose(
        [summ.coefficients.slope, *summ.coefficients.intercepts],
        [raw.coefficients.slope, *raw.coefficients.intercepts],
        rtol=1e-5,
        atol=1e-6,
    )
    a, b = summ.calibration, raw.calibration
    assert a.count == b.count
    # the sketch uses the service's bins: the measures agree to the bins' resolution
    assert a.auc == pytest.approx(b.auc, abs=1e-6)
    # (the probability sums travel as float32: 1e-7 relative)
    for name in ("logloss", "ece", "mean_predicted", "observed"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), abs=1e-6), name
    for pa, pb_ in zip(a.by_position, b.by_position, strict=True):
        assert pa.count == pb_.count
        assert pa.ece == pytest.approx(pb_.ece, abs=1e-6)
    # one message per worker per round, against one per step
    assert [s.acked for s in summ_stats] == [rounds] * WORKERS
    assert [s.acked for s in raw_stats] == [rounds * PER_WORKER] * WORKERS


def test_summaries_and_raw_steps_share_one_sequence_and_ledger(server, chat_steps):
    k, steps = chat_steps(0, 30)
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, rule="recursive", refit_interval=1000)
        fwd = client.forwarder(reg.pair_id, "mixed", k=k)
        c = reg.coefficients
        acc = RoundAccumulator(k)
        for i, (x, d, a) in enumerate(steps):
            acc.add(x, d, a, c.slope, c.intercepts)
            if i % 10 == 0:  # a raw step sampled next to the summaries
                fwd.submit(x, d, a, None)
            if i % 10 == 9:
                fwd.submit_summary(acc.take(c.version, c.slope, c.intercepts))
        assert fwd.flush(20)
        st = fwd.stats
        assert (st.submitted, st.acked, st.last_sequence, st.acked_sequence) == (6, 6, 6, 6)
        info = client.pair(reg.pair_id)
        assert info.steps_observed == 30 + 3  # three summaries of 10 plus three raw steps
    body = httpx.get(f"{server.http_url}/v1/pairs/{reg.pair_id}/workers", timeout=10).json()
    (row,) = body["workers"]
    assert (row["worker_id"], row["summaries"], row["raw_steps"]) == ("mixed", 3, 3)
    assert row["version"] == c.version and row["steps"] == 33 and row["mode"] == "summary"


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda s: setattr(s, "drafts", s.drafts + 1), "summary.drafts"),
        (lambda s: setattr(s, "k", s.k + 1), "summary.k"),
        (lambda s: s.info.append(1.0), "summary.info"),
        (lambda s: setattr(s, "steps", 0), "summary.steps"),
        (lambda s: s.sketch.ece_rejected.__setitem__(0, 99), "sketch."),
        (lambda s: s.sketch.cell_deltas.append(0), "sketch.cell_deltas"),
    ],
)
def test_a_malformed_summary_is_refused_and_changes_nothing(server, chat_steps, mutate, field):
    import grpc

    from avest_wire.v1 import estimator_pb2 as pb
    from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

    k, steps = chat_steps(0, 10)
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, rule="recursive", refit_interval=5)
        c = reg.coefficients
        acc = RoundAccumulator(k)
        for x, d, a in steps:
            acc.add(x, d, a, c.slope, c.intercepts)
        msg = summary_to_pb(acc.take(c.version, c.slope, c.intercepts))
        mutate(msg)
        req = pb.ObserveRequest(pair_id=reg.pair_id, worker_id="w", sequence=1, summary=msg)
        before = client.pair(reg.pair_id)
        with grpc.insecure_channel(server.grpc_address) as ch:
            stub = pb_grpc.EstimatorServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Observe(iter([req]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        after = client.pair(reg.pair_id)
        assert (after.steps_observed, after.coefficients.version) == (
            before.steps_observed,
            before.coefficients.version,
        )
