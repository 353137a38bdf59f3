"""A broken worker among honest ones, through the real gRPC server and client: it is
quarantined, shown in /v1/pairs/{id}/workers and on /metrics, and released by an admin."""

from __future__ import annotations

import httpx
import numpy as np

from avest.metrics import names as N
from avest_client import EstimatorClient
from tests.support import fleets as F
from tests.support.metrics import scrape, value
from tests.support.server import ADMIN_TOKEN
from tests.support.traces import load_trace

HONEST = 4
#: Steps each honest worker sends before the broken one starts, and the broken one's.
HONEST_STEPS = 60
BROKEN_STEPS = 40
#: Generous: the flushes wait for acknowledgements on a loaded machine.
FLUSH_S = 60.0


def test_a_broken_worker_is_quarantined_shown_and_released(server):
    trace = load_trace("sample")
    k = trace.k
    per_worker = F.worker_counts(trace, HONEST)
    with EstimatorClient(server.grpc_address, timeout=30) as client:
        reg = client.register("target", "draft", "draft_model", k, refit_interval=20)
        pid = reg.pair_id
        forwarders = [client.forwarder(pid, worker_id=f"honest-{i}") for i in range(HONEST)]
        for fwd, steps in zip(forwarders, per_worker, strict=True):
            for x, d, a in steps[:HONEST_STEPS]:
                fwd.submit(x, d, a)
        for fwd in forwarders:
            assert fwd.flush(FLUSH_S)
        # Valid steps, all at the feature clamp and all rejected.
        broken = client.forwarder(pid, worker_id="broken")
        for x, d, _ in per_worker[0][:BROKEN_STEPS]:
            broken.submit(np.full_like(x, 40.0), np.full_like(d, k), np.zeros_like(d))
        assert broken.flush(FLUSH_S)
        coefficients = client.coefficients(pid)
        for fwd in [*forwarders, broken]:
            fwd.close()

    http = httpx.Client(base_url=server.http_url, timeout=30)
    body = http.get(f"/v1/pairs/{pid}/workers").json()
    rows = {w["worker_id"]: w for w in body["workers"]}
    bad = rows["broken"]
    assert bad["state"] == "quarantined" and bad["score"] < -5.0 and bad["quarantines"] == 1
    assert bad["quarantined_steps"] + bad["held_steps"] >= BROKEN_STEPS - 5
    assert all(rows[f"honest-{i}"]["state"] == "ok" for i in range(HONEST))
    assert body["quarantined"] == 1 and body["quarantined_steps"] == bad["quarantined_steps"]
    # The pair kept its senses: intercepts nowhere near the broken worker's pull.
    assert coefficients.slope > 0.0 and max(map(abs, coefficients.intercepts)) < 5.0

    samples = scrape(server)
    assert value(samples, N.WORKERS_QUARANTINED, pair=pid) == 1.0
    assert value(samples, N.QUARANTINED_STEPS, pair=pid) == bad["quarantined_steps"]

    release = f"/v1/pairs/{pid}/workers/broken/release"
    assert http.post(release).status_code == 401
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    missing = http.post(f"/v1/pairs/{pid}/workers/nobody/release", headers=admin)
    assert missing.status_code == 404 and "nobody" in missing.json()["detail"]
    fine = http.post(f"/v1/pairs/{pid}/workers/honest-1/release", headers=admin)
    assert fine.status_code == 409 and "not quarantined" in fine.json()["detail"]
    assert http.post("/v1/pairs/0000/workers/broken/release", headers=admin).status_code == 404
    released = http.post(release, headers=admin)
    assert released.status_code == 200
    assert released.json()["state"] == "ok" and released.json()["score"] is None

    body = http.get(f"/v1/pairs/{pid}/workers").json()
    assert body["quarantined"] == 0
    assert value(scrape(server), N.WORKERS_QUARANTINED, pair=pid) == 0.0
    http.close()
