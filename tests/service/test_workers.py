"""The per-pair worker table: who sends what, over HTTP and metrics, bounded."""

from __future__ import annotations

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from avest.metrics import names as N
from avest.state.workers import OTHER, WorkerTable
from avest_wire.summary import make_summary
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.live import Live, register


def _summary(k: int, drafts: int, version: int = 0) -> pb.RoundSummary:
    counts = [0.0] * k
    counts[0] = float(drafts)
    return pb.RoundSummary(
        coefficients_version=version, slope=0.5, intercepts=[-0.2] * k, k=k,
        info=[0.25 * drafts, 0.0, 0.25 * drafts] + [0.0] * (3 * k - 3),
        grad=[0.0] * (2 * k), counts=counts, steps=10, drafts=drafts,
    )  # fmt: skip


def _send(live: Live, pair_id: str, workers: int, k: int = 5) -> None:
    reqs = [
        pb.ObserveRequest(pair_id=pair_id, worker_id=f"w{i:02d}", sequence=1, summary=_summary(k, i + 1))
        for i in range(workers)
    ]  # fmt: skip
    want = {r.worker_id for r in reqs}
    for resp in live.stub.Observe(iter(reqs), timeout=20):
        if resp.HasField("ack"):
            want.discard(resp.ack.worker_id)
        if not want:
            break


def test_workers_are_listed_over_http_and_folded_in_metrics(live: Live) -> None:
    pid = register(live, k=5, refit_interval=10_000)
    n = N.WORKER_SERIES + 4
    _send(live, pid, n)
    body = live.http.get(f"/v1/pairs/{pid}/workers").json()
    assert body["tracked"] == n and body["forgotten"] == 0
    assert [w["worker_id"] for w in body["workers"]][:2] == [f"w{n - 1:02d}", f"w{n - 2:02d}"]
    assert all(w["mode"] == "summary" and w["summaries"] == 1 for w in body["workers"])
    short = live.http.get(f"/v1/pairs/{pid}/workers", params={"limit": 3}).json()["workers"]
    assert [w["worker_id"] for w in short][-1] == OTHER and len(short) == 4
    assert sum(w["drafts"] for w in short) == n * (n + 1) // 2
    assert live.http.get("/v1/pairs/nope/workers").status_code == 404
    text = httpx.get(live.http_url + "/metrics", timeout=10).text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    drafts = {
        s.labels["worker"]: s.value for s in samples[N.WORKER_DRAFTS] if s.labels["pair"] == pid
    }
    assert len(drafts) == N.WORKER_SERIES + 1  # bounded: the rest in "other"
    assert drafts[OTHER] == sum(range(1, 5))  # the four seen first
    assert sum(drafts.values()) == n * (n + 1) // 2
    (workers,) = [s.value for s in samples[N.WORKERS] if s.labels["pair"] == pid]
    assert workers == n


def test_the_table_forgets_the_least_recently_seen_beyond_its_capacity() -> None:
    table = WorkerTable(capacity=3)
    s = make_summary(
        2, version=2, slope=0.5, intercepts=[-0.2] * 2, info=np.zeros((2, 3)),
        grad=np.zeros((2, 2)), counts=np.zeros(2), steps=5,
    )  # fmt: skip
    for w in ("a", "b", "c"):
        table.summary(w, s, lag=0)
    table.raw("a", labelled=7)  # a is seen again: b is now the oldest
    table.summary("d", s, lag=3)
    assert [r.worker_id for r in table.rows()] == ["d", "a", "c"]
    assert table.forgotten == 1
    a = next(r for r in table.rows() if r.worker_id == "a")
    assert (a.mode, a.raw_steps, a.summaries, a.steps, a.drafts) == ("raw", 1, 1, 6, 7)
    other = table.top(1)[-1]
    assert other.worker_id == OTHER and other.lag == 0 and other.steps == 11
