"""The draft-length schedule served (gRPC ``GetSchedule``, ``GET /v1/pairs/{id}/schedule``,
the client's ``schedule``): a real server fed the bundled trace, two hardware labels
whose cost curves call for opposite schedules."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

from avest.core.schedule import MIN_DRAFTS, vllm_lengths
from avest_client import EstimatorClient, FailedPreconditionError, NotFoundError
from avest_client.summary import RoundAccumulator
from avest_wire.messages import summary_to_pb
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import TOKEN, Live, messages, observe, observe_requests, register
from tests.support.metrics import scrape, select, value
from tests.support.serve import CLI
from tests.support.steps import trimmed_steps
from tests.support.traces import load_trace

K = 5
GOODPUT = "avest_schedule_expected_goodput_tokens_per_second"
LENGTH = "avest_schedule_num_speculative_tokens"


def _costs(live: Live, pair_id: str, hardware: str, verify_per_token: float) -> None:
    """A cheap drafter; a verify pass of 5 ms plus ``verify_per_token`` per token
    (linear above the capture limit of 1)."""
    verify = [(n, 5.0 + (n - 1) * verify_per_token) for n in (1, 2, 4096)]
    live.stub.SetCostCurves(
        pb.SetCostCurvesRequest(
            pair_id=pair_id,
            hardware=hardware,
            draft_curve=[pb.CostPoint(size=n, ms=ms) for n, ms in ((1, 0.2), (2, 0.2), (512, 0.4))],
            verify_curve=[pb.CostPoint(size=n, ms=ms) for n, ms in verify],
            cudagraph_capture_limit=1,
        ),
        timeout=10,
    )


@pytest.fixture
def fed(open_server: Callable[..., Live]) -> tuple[Live, str]:
    # every round refits as it fills: the version is settled once the steps are acked
    live = open_server(min_refit_interval_ms=0)
    pair_id = register(live, k=K)
    _costs(live, pair_id, "flat", 0.0)  # verifying more drafts costs nothing
    _costs(live, pair_id, "steep", 0.5)  # every token verified costs a tenth of a pass
    return live, pair_id


def test_a_schedule_waits_for_evidence_then_follows_the_cost_curves(fed: tuple[Live, str]) -> None:
    live, pair_id = fed
    with EstimatorClient(live.grpc_address) as client:
        with pytest.raises(FailedPreconditionError) as thin:
            client.schedule(pair_id, "flat")
        assert str(MIN_DRAFTS) in str(thin.value)
        with pytest.raises(NotFoundError) as unknown:
            client.schedule(pair_id, "tpu")
        assert "flat" in str(unknown.value) and "steep" in str(unknown.value)
        with pytest.raises(NotFoundError):
            client.schedule(pair_id)  # two labels: one must be named
        observe(live, messages(load_trace("sample"), pair_id))
        version = client.coefficients(pair_id).version
        flat, steep = client.schedule(pair_id, "flat"), client.schedule(pair_id, "steep")
    for s in (flat, steep):
        assert s.pair_id == pair_id and s.coefficients_version == version
        assert s.ranges[0].start == 1
        assert all(a.end + 1 == b.start for a, b in zip(s.ranges, s.ranges[1:], strict=False))
        for r in s.ranges:
            assert 0 <= r.num_speculative_tokens <= K
            # the choice is the best one expected, up to the switching margin
            assert r.expected_goodput >= 0.98 * r.best_fixed_goodput
        # vLLM's own reading of the ranges gives every batch size its range's length
        lookup = vllm_lengths(s.to_vllm(), 256, K)
        for r in s.ranges:
            assert lookup[r.start] == lookup[min(r.end, 256)] == r.num_speculative_tokens
    # free verification: speculate at every batch size; dear verification: not at large ones
    assert min(r.num_speculative_tokens for r in flat.ranges) >= 1
    assert steep.ranges[-1].num_speculative_tokens == 0
    assert steep.ranges[-1].num_speculative_tokens < flat.ranges[-1].num_speculative_tokens


def test_the_admin_api_serves_the_same_schedule(fed: tuple[Live, str]) -> None:
    live, pair_id = fed
    observe(live, messages(load_trace("sample"), pair_id))
    with EstimatorClient(live.grpc_address) as client:
        want = client.schedule(pair_id, "steep")
    got = live.http.get(f"/v1/pairs/{pair_id}/schedule", params={"hardware": "steep"})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["coefficients_version"] == want.coefficients_version
    assert [tuple(e) for e in body["num_speculative_tokens_per_batch_size"]] == want.to_vllm()
    assert [r["expected_goodput"] for r in body["ranges"]] == [
        r.expected_goodput for r in want.ranges
    ]
    assert live.http.get(f"/v1/pairs/{pair_id}/schedule").status_code == 404  # two labels
    # the metrics carry each range of the schedule last computed, per label
    samples = scrape(live)
    for r in want.ranges:
        at = {"pair": pair_id, "hardware": "steep", "range_start": str(r.start)}
        assert value(samples, GOODPUT, **at, choice="scheduled") == r.expected_goodput
        assert value(samples, GOODPUT, **at, choice="best_fixed") == r.best_fixed_goodput
        length = value(samples, LENGTH, **at, range_end=str(r.end))
        assert length == r.num_speculative_tokens
    assert not select(samples, GOODPUT, hardware="flat")  # never asked for
    missing = live.http.get(f"/v1/pairs/{pair_id}/schedule", params={"hardware": "tpu"})
    assert missing.status_code == 404 and "steep" in missing.json()["detail"]
    gone = live.http.delete(f"/v1/pairs/{pair_id}", headers={"Authorization": f"Bearer {TOKEN}"})
    assert gone.status_code == 200, gone.text
    assert not select(scrape(live), GOODPUT)  # its series go with the pair


def test_too_little_evidence_is_a_conflict_on_the_admin_api(fed: tuple[Live, str]) -> None:
    live, pair_id = fed
    got = live.http.get(f"/v1/pairs/{pair_id}/schedule", params={"hardware": "flat"})
    assert got.status_code == 409 and str(MIN_DRAFTS) in got.json()["detail"]


def test_the_command_prints_vllms_entry_and_a_table(fed: tuple[Live, str]) -> None:
    live, pair_id = fed
    observe(live, messages(load_trace("sample"), pair_id))
    with EstimatorClient(live.grpc_address) as client:
        want = client.schedule(pair_id, "steep")

    def avest(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", CLI, "schedule", *args, "--address", live.grpc_address],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    out = avest(pair_id, "--hardware", "steep")
    assert out.returncode == 0, out.stderr
    entry = json.loads(out.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert entry == {"num_speculative_tokens_per_batch_size": [list(e) for e in want.to_vllm()]}
    table = avest(pair_id, "--hardware", "steep", "--table")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert len(lines) == 3 + len(want.ranges) and lines[1].split()[0] == "batch"
    # the trace's raw steps carry every draft that reached its position
    assert lines[0].endswith("features of the reached drafts"), lines[0]
    thin = avest(register(live, k=K, target="another"), "--hardware", "steep")
    assert thin.returncode == 1 and len(thin.stderr.strip().splitlines()) == 1
    assert "NOT_FOUND" in thin.stderr  # no cost curves for a new pair


def test_the_schedule_reads_every_draft_that_reached_a_position(
    open_server: Callable[..., Live],
) -> None:
    # Steps as adaptive verification leaves them (drafts with x < 0 trimmed): three pairs
    # see the same steps, as round summaries with reached counts, as raw steps, and as
    # summaries without them (a worker that sends none).
    live = open_server(min_refit_interval_ms=0)
    steps = trimmed_steps(40, 60, K, seed=7)
    ids = {name: register(live, k=K, refit_interval=1_000_000, run=name) for name in
           ("summaries", "raw", "bare")}  # fmt: skip
    for pair_id in ids.values():
        _costs(live, pair_id, "steep", 0.5)
    observe(live, observe_requests(steps, ids["raw"]))
    for name, reached in (("summaries", True), ("bare", False)):
        msgs = []
        for seq, start in enumerate(range(0, len(steps), 10), start=1):
            acc = RoundAccumulator(K, reached=reached)
            for x, d, a in steps[start : start + 10]:
                acc.add(x, d, a, 0.5, [-0.2] * K)  # the cold start the pair serves
            s = acc.take(0, 0.5, [-0.2] * K)
            assert s is not None
            msgs.append(
                pb.ObserveRequest(
                    pair_id=ids[name],
                    worker_id="w0",
                    sequence=seq,
                    k=K,
                    summary=summary_to_pb(s),
                )  # fmt: skip
            )
        assert observe(live, msgs) == len(msgs)
    got = {}
    for name, pair_id in ids.items():
        r = live.http.get(f"/v1/pairs/{pair_id}/schedule", params={"hardware": "steep"})
        assert r.status_code == 200, r.text
        got[name] = r.json()
    assert got["summaries"]["features"] == got["raw"]["features"] == "reached"
    assert got["bare"]["features"] == "labelled"
    with EstimatorClient(live.grpc_address) as client:  # gRPC says the same
        assert {n: client.schedule(p, "steep").features for n, p in ids.items()} == {
            "summaries": "reached",
            "raw": "reached",
            "bare": "labelled",
        }
    # the same drafts counted either way give the same schedule, expected goodput and all
    assert got["summaries"]["ranges"] == got["raw"]["ranges"]
    # the labelled drafts alone miss the trimmed (unconfident) ones: a rosier expectation
    ours = [r["expected_goodput"] for r in got["summaries"]["ranges"]]
    rosy = [r["expected_goodput"] for r in got["bare"]["ranges"]]
    assert ours != rosy
    speculating = [r for r in got["bare"]["ranges"] if r["num_speculative_tokens"] > 0]
    assert speculating, got["bare"]
    start = speculating[0]["range_start"]
    at = {r["range_start"]: r for r in got["summaries"]["ranges"]}
    if (
        start in at
        and at[start]["num_speculative_tokens"] == speculating[0]["num_speculative_tokens"]
    ):
        assert at[start]["expected_goodput"] < speculating[0]["expected_goodput"]
