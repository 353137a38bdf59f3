"""``avest record`` against a real service: a sampled fraction of a pair's raw steps
becomes an avest-trace/1 file with the same features and labels; summaries are not
recorded; the admin routes need the token."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest

from avest.commands.cli import main
from avest.offline.trace import read_trace
from avest_client import EstimatorClient
from avest_client.summary import RoundAccumulator

pytestmark = pytest.mark.slow


def test_record_writes_the_sampled_raw_steps_as_a_trace(open_server, trace_slice, tmp_path, capsys):
    from tests.support.live import TOKEN

    live = open_server()
    server = live.handle
    auth = {"Authorization": f"Bearer {TOKEN}"}
    trace = trace_slice("chat", 0, 60)
    steps = [(s.features, s.num_verified, s.num_accepted) for s in trace.steps()]
    out = tmp_path / "rec.npz"
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register("t", "d", "draft_model", trace.k, {"temperature": "0.7"})
        args = ["record", reg.pair_id, str(out), "--http", server.http_url]
        args += ["--fraction", "0.5", "--steps", "20", "--timeout", "30", "--token", TOKEN]
        rc: list[int] = []
        t = threading.Thread(target=lambda: rc.append(main(args)))
        t.start()
        status = f"{server.http_url}/v1/pairs/{reg.pair_id}/recording"
        deadline = time.monotonic() + 10
        while httpx.get(status, headers=auth).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        fwd = client.forwarder(reg.pair_id, "w", k=trace.k)
        acc = RoundAccumulator(trace.k)
        c = reg.coefficients
        for x, d, a in steps:
            fwd.submit(x, d, a, None)
            acc.add(x, d, a, c.slope, c.intercepts)
        fwd.submit_summary(acc.take(c.version, c.slope, c.intercepts))  # not recorded
        assert fwd.flush(20)
        t.join(40)
    assert rc == [0]
    assert "recorded 20 steps" in capsys.readouterr().out
    got = read_trace(out)
    assert got.k == trace.k and got.num_steps == 20
    assert got.meta["target"] == "t" and got.meta["temperature"] == 0.7
    want = [steps[i] for i in range(1, 40, 2)]  # every second step offered
    kept = list(got.steps())
    for rec, (x, d, a) in zip(kept, want, strict=True):
        np.testing.assert_array_equal(rec.features, x)
        obs_r, acc_r = rec.labels()
        from avest.core.labels import labels

        obs_w, acc_w = labels(d.astype(np.int64), a.astype(np.int64), trace.k)
        np.testing.assert_array_equal(obs_r, obs_w)
        np.testing.assert_array_equal(acc_r, acc_w)
    # the recording was removed once downloaded
    assert httpx.get(status, headers=auth).status_code == 404


def test_recording_routes_need_the_admin_token(open_server) -> None:
    from tests.support.live import TOKEN, register

    live = open_server()
    pid = register(live)
    url = f"/v1/pairs/{pid}/recording"
    assert live.http.post(url).status_code == 401
    assert live.http.post(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = live.http.post(url, params={"steps": 5}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["kept"] == 0
    assert live.http.post("/v1/pairs/nope/recording", headers={
        "Authorization": f"Bearer {TOKEN}"}).status_code == 404  # fmt: skip
    assert live.http.post(url, params={"fraction": 0}, headers={
        "Authorization": f"Bearer {TOKEN}"}).status_code == 422  # fmt: skip
    assert live.http.delete(url).status_code == 401
