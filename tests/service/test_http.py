"""The admin HTTP API of a real service on 127.0.0.1:0: health, pairs, history,
reliability diagram (SVG parsed as XML), reset with the admin token, 4xx bodies,
OpenAPI. Data goes in through the real gRPC API."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import avest
from avest.core.estimator import DEFAULT_RECENT_DECAY
from avest.core.model import INIT_INTERCEPT, INIT_SLOPE
from avest.http.api import build_http
from avest.settings import Settings
from avest_wire.v1 import estimator_pb2 as pb
from tests.support.http import feed, register
from tests.support.live import TOKEN
from tests.support.live import Live as _Live

SVG = "{http://www.w3.org/2000/svg}"
# -- helpers --------------------------------------------------------------------


@pytest.fixture
def fed(live: _Live, trace_slice: Any) -> tuple[_Live, str]:
    """A live server with one pair that has seen 150 steps of the bundled trace."""
    trace = trace_slice("sample", 0, 150)
    pid = register(live, k=trace.k, refit_interval=10, workload="chat")
    feed(live, trace, pid)
    return live, pid


def _null_as_zero(v: float | None) -> float:
    return 0.0 if v is None else v


# -- health ---------------------------------------------------------------------------


def test_health_and_metrics_endpoints(live: _Live) -> None:
    r = live.http.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "version": avest.__version__}
    r = live.http.get("/readyz")
    assert r.status_code == 200 and r.json() == {"status": "ready"}
    r = live.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "avest_pairs 0.0" in r.text


class _StubApp:
    """Just what /readyz reads."""

    def __init__(self, ready: bool, draining: bool = False) -> None:
        self.ready = ready
        self.draining = draining


@pytest.mark.parametrize(
    ("ready", "draining", "status", "body"),
    [
        (False, False, 503, "starting"),
        (True, True, 503, "draining"),
        (True, False, 200, "ready"),
    ],
)
async def test_readyz_is_503_until_ready_and_while_draining(
    ready: bool, draining: bool, status: int, body: str
) -> None:
    api = build_http(_StubApp(ready, draining), metrics=None, settings=Settings())
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://avest") as client:
        r = await client.get("/readyz")
    assert r.status_code == status and r.json() == {"status": body}


def test_readyz_is_503_draining_while_a_real_server_stops(
    open_server: Callable[..., _Live],
) -> None:
    """Server.stop() marks the app draining first thing; /readyz (still served
    until the very end of the drain) answers 503 "draining" from then on. The
    drain is held just after that (at the health service's graceful shutdown)
    until the probe has answered, so the order is fixed, not raced."""
    live = open_server(grace_s=30.0)
    handle = live.handle
    server = handle.server
    assert live.http.get("/readyz").json() == {"status": "ready"}
    assert server.app.draining is False

    reached = threading.Event()
    release = threading.Event()
    graceful_shutdown = server.health.enter_graceful_shutdown

    async def held_graceful_shutdown() -> None:
        reached.set()
        while not release.is_set():
            await asyncio.sleep(0.005)
        await graceful_shutdown()

    server.health.enter_graceful_shutdown = held_graceful_shutdown
    stopping = asyncio.run_coroutine_threadsafe(server.stop(), handle.loop)
    try:
        assert reached.wait(10), "stop() never reached the graceful shutdown"
        assert server.app.draining is True
        r = live.http.get("/readyz")
        assert r.status_code == 503 and r.json() == {"status": "draining"}
        # Liveness is unaffected: the process still answers.
        r = live.http.get("/healthz")
        assert r.status_code == 200 and r.json() == {"status": "ok", "version": avest.__version__}
    finally:
        release.set()
        stopping.result(30)
    assert server.app.draining is True and not server.app.ready
    live.close()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{live.http_url}/readyz", timeout=5)


# -- pairs ------------------------------------------------------------------------------


def test_pair_json_matches_get_pair(fed: tuple[_Live, str]) -> None:
    live, pid = fed
    got = live.http.get(f"/v1/pairs/{pid}").json()
    want = live.stub.GetPair(pb.GetPairRequest(pair_id=pid), timeout=10).pair
    assert got["id"] == want.pair_id == pid
    assert got["key"] == {
        "target": want.key.target_model,
        "draft": want.key.draft_model,
        "method": want.key.method,
        "k": want.key.num_speculative_tokens,
        "labels": {"workload": "chat"},
    }
    assert got["K"] == want.key.num_speculative_tokens == 5
    assert got["rule"] == "vllm" and want.update_rule == pb.UPDATE_RULE_VLLM
    assert got["refit_interval"] == want.refit_interval == 10
    assert got["coefficients"]["slope"] == want.coefficients.slope
    assert got["coefficients"]["intercepts"] == list(want.coefficients.intercepts)
    assert (got["version"], got["round"]) == (want.coefficients.version, want.coefficients.round)
    assert got["round"] == 15
    assert got["observed_drafts"] == want.drafts_observed > 0
    assert got["observed_steps"] == want.steps_observed == 150
    cal, wcal = got["calibration"], want.calibration
    assert cal["count"] == wcal.count
    for name in ("auc", "logloss", "ece", "mean_predicted", "observed"):
        assert cal[name] == pytest.approx(getattr(wcal, name), abs=1e-12), name
    assert len(cal["by_position"]) == len(wcal.by_position) == 5
    for i, (p, w) in enumerate(zip(cal["by_position"], wcal.by_position, strict=True)):
        assert p["position"] == i
        assert p["count"] == w.count
        for name in ("auc", "logloss", "ece", "mean_predicted", "observed"):
            assert _null_as_zero(p[name]) == pytest.approx(getattr(w, name), abs=1e-12)

    # The recent calibration has the same shape (its values: see the next test).
    recent = got["recent_calibration"]
    assert set(recent) == set(cal)
    assert [set(p) for p in recent["by_position"]] == [set(p) for p in cal["by_position"]]
    assert [p["position"] for p in recent["by_position"]] == list(range(5))

    listed = live.http.get("/v1/pairs").json()
    assert [p["id"] for p in listed["pairs"]] == [pid]
    assert listed["pairs"][0] == got


def test_recent_calibration_is_the_decayed_window(fed: tuple[_Live, str], trace_slice: Any) -> None:
    """Each closed round weighs 0.95 per round closed after it: 150 steps at
    refit_interval 10 are 15 rounds, so round r's drafts count 0.95 ** (14 - r).
    The measures are those /metrics exposes as avest_recent_*."""
    live, pid = fed
    trace = trace_slice("sample", 0, 150)
    got = live.http.get(f"/v1/pairs/{pid}").json()
    rounds = [trace.slice_steps(10 * r, 10 * r + 10).labelled_count() for r in range(15)]
    weighted = sum(n * DEFAULT_RECENT_DECAY ** (14 - r) for r, n in enumerate(rounds))
    recent, cal = got["recent_calibration"], got["calibration"]
    assert cal["count"] == sum(rounds)
    assert recent["count"] == pytest.approx(weighted, rel=1e-9)
    assert recent["count"] < cal["count"]
    assert sum(p["count"] for p in recent["by_position"]) == pytest.approx(weighted, rel=1e-9)

    metrics = live.http.get("/metrics").text

    def gauge(name: str, **labels: str) -> float:
        sel = ",".join(f'{k}="{v}"' for k, v in {"pair": pid, **labels}.items())
        m = re.search(rf"^{name}\{{{sel}\}} (\S+)$", metrics, re.M)
        assert m, (name, labels)
        return float(m.group(1))

    for field, name in (("auc", "avest_recent_auc"), ("ece", "avest_recent_ece")):
        assert recent[field] == pytest.approx(gauge(name), abs=1e-12)
    assert recent["logloss"] == pytest.approx(gauge("avest_recent_log_loss"), abs=1e-12)
    for p in recent["by_position"]:
        pos = str(p["position"])
        predicted = gauge("avest_recent_predicted_acceptance", position=pos)
        observed = gauge("avest_recent_observed_acceptance", position=pos)
        assert p["mean_predicted"] == pytest.approx(predicted, abs=1e-12)
        assert p["observed"] == pytest.approx(observed, abs=1e-12)


def test_undefined_measures_are_null(live: _Live) -> None:
    pid = register(live, k=3)
    got = live.http.get(f"/v1/pairs/{pid}").json()
    assert got["coefficients"] == {"slope": INIT_SLOPE, "intercepts": [INIT_INTERCEPT] * 3}
    cal = got["calibration"]
    assert cal["count"] == 0
    assert all(cal[n] is None for n in ("auc", "logloss", "ece", "mean_predicted", "observed"))
    assert [p["auc"] for p in cal["by_position"]] == [None, None, None]
    assert got["recent_calibration"] == cal


def test_history_lists_registration_and_refits(fed: tuple[_Live, str]) -> None:
    live, pid = fed
    h = live.http.get(f"/v1/pairs/{pid}/history").json()
    assert h["id"] == pid
    entries = h["history"]
    assert entries[0]["outcome"] == "registered" and entries[0]["version"] == 0
    assert len(entries) == 1 + 15
    assert [e["round"] for e in entries] == list(range(16))
    last = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert entries[-1]["version"] == last.version
    assert entries[-1]["slope"] == last.slope
    assert (
        live.http.get(f"/v1/pairs/{pid}/history", params={"limit": 2}).json()["history"]
        == (entries[-2:])
    )


# -- the reliability diagram ---------------------------------------------------------------


def test_reliability_svg_has_one_point_per_non_empty_bin(fed: tuple[_Live, str]) -> None:
    live, pid = fed
    r = live.http.get(f"/v1/pairs/{pid}/reliability.svg")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("image/svg+xml")
    root = ET.fromstring(r.content)
    assert root.tag == SVG + "svg"

    bins = live.http.get(f"/v1/pairs/{pid}/reliability").json()["bins"]
    assert len(bins) == 15
    non_empty = [b for b in bins if b["count"] > 0]
    assert len(non_empty) >= 3
    points = [c for c in root.iter() if c.get("class") == "bin"]
    assert [int(c.get("data-bin")) for c in points] == [b["bin"] for b in non_empty]
    for c, b in zip(points, non_empty, strict=True):
        assert float(c.get("data-count")) == pytest.approx(b["count"], rel=1e-5)
        assert float(c.get("data-predicted")) == pytest.approx(b["mean_predicted"], abs=1e-6)
        assert float(c.get("data-observed")) == pytest.approx(b["observed"], abs=1e-6)
        assert b["lower"] <= b["mean_predicted"] <= b["upper"]
    # Counts over all bins are the calibration count.
    pair = live.http.get(f"/v1/pairs/{pid}").json()
    assert sum(b["count"] for b in bins) == pytest.approx(pair["calibration"]["count"])

    # Predicted and observed acceptance per position: one point each per position.
    by_pos = pair["calibration"]["by_position"]
    predicted = [e for e in root.iter() if e.get("class") == "predicted"]
    observed = [e for e in root.iter() if e.get("class") == "observed"]
    assert [int(e.get("data-position")) for e in predicted] == list(range(5))
    assert [int(e.get("data-position")) for e in observed] == list(range(5))
    for e, p in zip(predicted, by_pos, strict=True):
        assert float(e.get("data-value")) == pytest.approx(p["mean_predicted"], abs=1e-6)
    for e, p in zip(observed, by_pos, strict=True):
        assert float(e.get("data-value")) == pytest.approx(p["observed"], abs=1e-6)
    # The key's free text is escaped, not markup.
    texts = "".join(t.text or "" for t in root.iter(SVG + "text"))
    assert "target <model> & co" in texts


def test_reliability_of_one_position(fed: tuple[_Live, str]) -> None:
    live, pid = fed
    pair = live.http.get(f"/v1/pairs/{pid}").json()
    one = live.http.get(f"/v1/pairs/{pid}/reliability", params={"position": 2}).json()
    assert one["position"] == 2
    assert sum(b["count"] for b in one["bins"]) == pytest.approx(
        pair["calibration"]["by_position"][2]["count"]
    )
    svg = live.http.get(f"/v1/pairs/{pid}/reliability.svg", params={"position": 2})
    root = ET.fromstring(svg.content)
    points = [c for c in root.iter() if c.get("class") == "bin"]
    assert len(points) == sum(1 for b in one["bins"] if b["count"] > 0)
    for bad in (5, -1):
        r = live.http.get(f"/v1/pairs/{pid}/reliability.svg", params={"position": bad})
        assert r.status_code == 422
        assert f"got {bad}" in r.json()["detail"] and pid in r.json()["detail"]


def test_reliability_svg_of_a_fresh_pair_is_valid_and_empty(live: _Live) -> None:
    pid = register(live, k=2)
    r = live.http.get(f"/v1/pairs/{pid}/reliability.svg")
    assert r.status_code == 200
    root = ET.fromstring(r.content)
    assert not [c for c in root.iter() if c.get("class") == "bin"]
    assert not [e for e in root.iter() if e.get("class") in ("predicted", "observed")]
    assert "no verified drafts yet" in r.text


# -- reset --------------------------------------------------------------------------------


def test_reset_needs_the_admin_token(fed: tuple[_Live, str]) -> None:
    live, pid = fed
    before = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert before.round == 15

    r = live.http.post(f"/v1/pairs/{pid}/reset")
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert "token" in r.json()["detail"]
    r = live.http.post(f"/v1/pairs/{pid}/reset", headers={"Authorization": "Basic eDp5"})
    assert r.status_code == 401
    r = live.http.post(f"/v1/pairs/{pid}/reset", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json() == {"detail": "unknown token"}
    # Refused: nothing changed.
    same = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert (same.version, same.round, same.slope) == (before.version, before.round, before.slope)

    r = live.http.post(f"/v1/pairs/{pid}/reset", headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200
    body = r.json()
    after = live.stub.GetCoefficients(pb.GetCoefficientsRequest(pair_id=pid)).coefficients
    assert after.slope == INIT_SLOPE and list(after.intercepts) == [INIT_INTERCEPT] * 5
    assert after.round == 0
    # The version moves on (never back), so watchers see the reset as an update.
    assert after.version > before.version
    assert (body["version"], body["round"]) == (after.version, 0)
    assert body["coefficients"] == {"slope": INIT_SLOPE, "intercepts": [INIT_INTERCEPT] * 5}
    assert body["observed_drafts"] == 0 and body["calibration"]["count"] == 0
    assert body["recent_calibration"]["count"] == 0
    history = live.http.get(f"/v1/pairs/{pid}/history").json()["history"]
    assert [e["outcome"] for e in history] == ["reset"]
    metrics = live.http.get("/metrics").text
    assert f'avest_drafts_observed_total{{pair="{pid}"}} 0.0' in metrics
    assert f'avest_coefficients_version{{pair="{pid}"}} {float(after.version)}' in metrics


def test_reset_without_a_configured_token_is_refused(open_server: Callable[..., _Live]) -> None:
    # Found: with no admin token configured, anyone could reset any pair.
    live = open_server(admin_token="")
    pid = register(live, k=2)
    r = live.http.post(f"/v1/pairs/{pid}/reset")
    assert r.status_code == 403 and "no admin token" in r.json()["detail"]
    r = live.http.post(f"/v1/pairs/{pid}/reset", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403


# -- 4xx bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/pairs/{id}"),
        ("GET", "/v1/pairs/{id}/history"),
        ("GET", "/v1/pairs/{id}/reliability"),
        ("GET", "/v1/pairs/{id}/reliability.svg"),
        ("POST", "/v1/pairs/{id}/reset"),
    ],
)
def test_unknown_pair_is_404_naming_the_id(live: _Live, method: str, path: str) -> None:
    missing = "feedfacecafebeef"
    r = live.http.request(
        method, path.format(id=missing), headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")
    assert r.json() == {"detail": f"unknown pair_id {missing!r}"}


def test_reset_checks_the_token_before_the_pair(live: _Live) -> None:
    r = live.http.post("/v1/pairs/feedfacecafebeef/reset")
    assert r.status_code == 401  # an unauthenticated caller learns nothing about ids


# -- OpenAPI ---------------------------------------------------------------------------------


def test_openapi_documents_the_api(live: _Live) -> None:
    docs = live.http.get("/docs")
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    spec = live.http.get("/openapi.json").json()
    paths = spec["paths"]
    for p in (
        "/healthz",
        "/readyz",
        "/metrics",
        "/v1/pairs",
        "/v1/pairs/{pair_id}",
        "/v1/pairs/{pair_id}/history",
        "/v1/pairs/{pair_id}/reliability",
        "/v1/pairs/{pair_id}/reliability.svg",
        "/v1/pairs/{pair_id}/reset",
    ):
        assert p in paths, p
    schemas = spec["components"]["schemas"]
    pair = schemas["PairOut"]["properties"]
    fields = "id key K rule refit_interval coefficients version round calibration"
    assert {*fields.split(), "recent_calibration"} <= set(pair)
    assert set(schemas["CalibrationOut"]["properties"]) >= {
        "auc",
        "logloss",
        "ece",
        "mean_predicted",
        "observed",
        "by_position",
    }
    get_pair = paths["/v1/pairs/{pair_id}"]["get"]["responses"]
    assert get_pair["404"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorOut")
    reset = paths["/v1/pairs/{pair_id}/reset"]["post"]
    assert reset["security"] and {"401", "403", "404"} <= set(reset["responses"])
    assert (
        "image/svg+xml"
        in paths["/v1/pairs/{pair_id}/reliability.svg"]["get"]["responses"]["200"]["content"]
    )


def test_nan_never_reaches_json(fed: tuple[_Live, str]) -> None:
    live, pid = fed
    text = live.http.get(f"/v1/pairs/{pid}").text
    assert "NaN" not in text and "Infinity" not in text
    for b in live.http.get(f"/v1/pairs/{pid}/reliability").json()["bins"]:
        assert b["count"] > 0 or (b["mean_predicted"] is None and b["observed"] is None)
        if b["mean_predicted"] is not None:
            assert math.isfinite(b["mean_predicted"])
