"""EstimatorClient and AsyncEstimatorClient against a real server on 127.0.0.1:0."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest

from avest.core.budget import decide
from avest.core.costs import CostTable
from avest.core.model import Coefficients as CoreCoefficients
from avest.core.model import predict, survival
from avest_client import (
    AsyncEstimatorClient,
    AvestError,
    Coefficients,
    DeadlineExceededError,
    EstimatorClient,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from tests.support import server as service_conftest
from tests.support.helpers import free_port

ADMIN_TOKEN = service_conftest.ADMIN_TOKEN

K = 5
DRAFT = [(1, 1.0), (8, 1.2), (16, 1.5), (64, 2.5), (256, 6.0)]
VERIFY = [(1, 8.0), (16, 8.5), (64, 10.0), (256, 14.0), (1024, 30.0), (4096, 95.0)]


def register(client: EstimatorClient, **kw):
    args = dict(target="target/model", draft="draft/model", method="draft_model", k=K)
    args.update(kw)
    return client.register(**args)


def features(rows: int, k: int = K, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(0.0, 3.0, size=(rows, k)).astype(np.float32)


def core_coefficients(c: Coefficients) -> CoreCoefficients:
    return CoreCoefficients(c.slope, tuple(c.intercepts))


def test_register_is_idempotent(server):
    with EstimatorClient(server.grpc_address, timeout=5) as client:
        first = register(client, labels={"workload": "chat"}, rule="vllm", refit_interval=17)
        again = register(client, labels={"workload": "chat"})
        other = register(client, labels={"workload": "code"})
    assert first.created and not again.created
    assert first.pair_id == again.pair_id != other.pair_id
    assert (first.rule, first.refit_interval) == ("vllm", 17)
    assert (again.rule, again.refit_interval) == ("vllm", 17)
    c = first.coefficients
    assert c.pair_id == first.pair_id and c.k == K
    assert c.slope == 0.5 and c.intercepts == (-0.2,) * K  # cold start
    assert other.rule == server.settings.default_rule
    assert other.refit_interval == server.settings.refit_interval


def test_coefficients_pairs_and_pair(server):
    with EstimatorClient(server.grpc_address) as client:
        reg = register(client, labels={"t": "1"})
        c = client.coefficients(reg.pair_id)
        assert c == reg.coefficients
        pairs = client.pairs()
        assert [p.pair_id for p in pairs] == [reg.pair_id]
        info = client.pair(reg.pair_id)
    assert repr(info) == repr(pairs[0])  # NaN (undefined) measures compare unequal
    assert info.key.target == "target/model" and info.key.k == K
    assert info.key.labels == {"t": "1"}
    assert info.coefficients == c
    assert (info.steps_observed, info.drafts_observed) == (0, 0)
    assert len(info.calibration.by_position) == K


def test_score_equals_the_core(server):
    with EstimatorClient(server.grpc_address) as client:
        reg = register(client)
        x = features(256)
        conf, surv = client.score(reg.pair_id, x)
    p = predict(core_coefficients(reg.coefficients), x)
    assert conf.dtype == np.float32 and conf.shape == (256, K)
    np.testing.assert_array_equal(conf, p.astype(np.float32))
    np.testing.assert_array_equal(surv, survival(p).astype(np.float32))


@pytest.mark.parametrize("rule", [None, "lossless-walk", "stale", "argmax", "full"])
def test_budget_equals_the_core(server, rule):
    rng = np.random.default_rng(3)
    rows = 48
    conf = rng.uniform(0, 1, size=(rows, K)).astype(np.float32)
    stale = rng.uniform(0, 1, size=(rows, K)).astype(np.float32)
    scheduled = rng.integers(0, K + 1, size=rows)
    with EstimatorClient(server.grpc_address, token=ADMIN_TOKEN) as client:
        reg = register(client)
        client.set_cost_curves(reg.pair_id, DRAFT, VERIFY, cudagraph_limit=512, hardware="h200")
        got = client.budget(
            reg.pair_id,
            conf,
            scheduled,
            num_non_draft_tokens=rows,
            num_sampling=rows,
            stale_confidences=stale if rule in (None, "stale") else None,
            hardware="h200",
            rule=rule,
            min_per_request=1,
        )
    table = CostTable.from_curves(DRAFT, VERIFY, cudagraph_limit=512)
    expect_rule = rule or "stale"  # the default with stale confidences given
    want = decide(
        expect_rule,
        conf.astype(np.float64),
        scheduled,
        table,
        num_non_draft_tokens=rows,
        num_sampling=rows,
        stale_confidences=stale.astype(np.float64) if expect_rule == "stale" else None,
        min_per_request=1,
    )
    assert got.rule == want.rule == expect_rule
    assert got.budget == want.budget
    np.testing.assert_array_equal(got.verify_lengths, want.verify_lengths)
    assert got.expected_tokens == want.expected_tokens
    assert got.cost_ms == want.cost_ms
    assert got.lossless == want.lossless


def test_budget_default_without_stale_is_the_lossless_walk(server):
    conf = np.full((4, K), 0.9, dtype=np.float32)
    with EstimatorClient(server.grpc_address, token=ADMIN_TOKEN) as client:
        reg = register(client)
        client.set_cost_curves(reg.pair_id, dict(DRAFT), dict(VERIFY))
        got = client.budget(reg.pair_id, conf, [K] * 4, num_non_draft_tokens=4, num_sampling=4)
        assert got.rule == "lossless-walk" and got.lossless
        assert client.pair(reg.pair_id).cost_curve_hardware == ("",)


def test_cost_curves_in_any_order_are_accepted(server):
    with EstimatorClient(server.grpc_address, token=ADMIN_TOKEN) as client:
        reg = register(client)
        client.set_cost_curves(reg.pair_id, DRAFT[::-1], VERIFY[::-1], hardware="x")
        assert client.pair(reg.pair_id).cost_curve_hardware == ("x",)


def test_errors_map_to_the_hierarchy_with_the_server_message(server):
    with EstimatorClient(server.grpc_address, token=ADMIN_TOKEN) as client:
        reg = register(client)
        with pytest.raises(NotFoundError) as e:
            client.coefficients("no-such-pair")
        assert "no-such-pair" in e.value.message and e.value.method == "GetCoefficients"
        assert isinstance(e.value, AvestError) and isinstance(e.value, LookupError)
        with pytest.raises(NotFoundError):
            client.score("no-such-pair", features(2))
        with pytest.raises(InvalidArgumentError) as e:
            client.score(reg.pair_id, features(3, k=K + 1))
        assert e.value.message.startswith("k:") and f"K={K}" in e.value.message
        with pytest.raises(InvalidArgumentError) as e:
            client.score(reg.pair_id, np.full((2, K), 99.0, dtype=np.float32))
        assert "features" in e.value.message
        with pytest.raises(FailedPreconditionError) as e:
            client.budget(reg.pair_id, np.zeros((2, K)), [1, 1], 2, 2, hardware="nope")
        assert "nope" in e.value.message
        with pytest.raises(InvalidArgumentError) as e:
            client.set_cost_curves(reg.pair_id, [(1, -1.0)], VERIFY)
        assert "draft_curve" in e.value.message
        with pytest.raises(InvalidArgumentError) as e:
            client.register("", "d", "m", K)
        assert "target_model" in e.value.message
        with pytest.raises(FailedPreconditionError):  # conflicting re-registration
            register(client, rule="vllm" if reg.rule == "recursive" else "recursive")
        # Refused locally, before any call: still the same hierarchy.
        with pytest.raises(InvalidArgumentError):
            client.score(reg.pair_id, np.zeros(K))
        with pytest.raises(InvalidArgumentError):
            client.register("t", "d", "m", K, rule="bogus")


def test_unreachable_server_and_deadlines():
    with EstimatorClient(f"127.0.0.1:{free_port()}", timeout=0.5) as client:
        with pytest.raises(UnavailableError):
            client.coefficients("x")
        with pytest.raises((UnavailableError, DeadlineExceededError)):
            client.coefficients("x", timeout=0.2)
        with pytest.raises(UnavailableError):
            client.wait_for_ready(timeout=0.2)


def test_watch_iterator_gets_an_update_after_a_refit(server, chat_steps):
    k, steps = chat_steps(0, 10)
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register("t", "d", "m", k, refit_interval=10, rule="vllm")
        watch = client.watch(reg.pair_id)
        first = next(watch)
        assert first == reg.coefficients and first.version == reg.coefficients.version
        fwd = client.forwarder(reg.pair_id)
        for s in steps:
            fwd.submit(*s, None)
        second = next(watch)
        watch.cancel()
        assert list(watch) == []  # cancelled: the iterator ends
        fwd.close()
        assert second.version == first.version + 1 and second.round == 1
        assert second == client.coefficients(reg.pair_id)
        latest = fwd.latest_coefficients()
        assert latest is not None
        assert (latest.version, latest.slope, latest.intercepts) == (
            second.version,
            second.slope,
            tuple(second.intercepts),
        )


def test_watch_callback_runs_on_a_thread_and_stops(server, chat_steps):
    k, steps = chat_steps(0, 30)
    got: list[Coefficients] = []
    seen = threading.Event()

    def on_update(c: Coefficients) -> None:
        got.append(c)
        if c.round == 3:
            seen.set()

    with EstimatorClient(server.grpc_address) as client:
        reg = client.register("t", "d", "m", k, rule="recursive", refit_interval=10)
        watcher = client.watch(reg.pair_id, on_update)
        with client.forwarder(reg.pair_id) as fwd:
            for s in steps:
                fwd.submit(*s, None)
            assert seen.wait(10)
        watcher.cancel()
        assert not watcher.running
    versions = [c.version for c in got]
    assert versions == sorted(set(versions)) and versions[0] == reg.coefficients.version
    assert got[-1].round == 3


def test_watch_callback_reports_an_unknown_pair(server):
    errors = []
    done = threading.Event()
    with EstimatorClient(server.grpc_address) as client:
        watcher = client.watch(
            "nope", lambda c: None, on_error=lambda e: (errors.append(e), done.set())
        )
        assert done.wait(5)
        watcher.cancel()
    assert isinstance(errors[0], NotFoundError)


def test_a_changed_pid_recreates_the_channel(server):
    client = EstimatorClient(server.grpc_address)
    assert client._lazy.channel is None  # lazy: nothing before the first call
    reg = register(client)
    first = client._lazy.channel
    assert first is not None
    client._lazy.pid = -1  # as if this process were a fork of the one that created it
    assert client.coefficients(reg.pair_id) == reg.coefficients
    assert client._lazy.channel is not first and client._lazy.pid == os.getpid()
    first.close()
    client.close()


def test_closed_client_refuses_calls(server):
    client = EstimatorClient(server.grpc_address)
    register(client)
    client.close()
    client.close()
    with pytest.raises(AvestError):
        client.pairs()


# -- asyncio ------------------------------------------------------------------


async def test_async_client_matches_the_sync_one(server, chat_steps):
    k, steps = chat_steps(0, 10)
    async with AsyncEstimatorClient(server.grpc_address, timeout=5, token=ADMIN_TOKEN) as client:
        reg = await client.register("t", "d", "m", k, refit_interval=10, rule="recursive")
        again = await client.register("t", "d", "m", k)
        assert reg.created and not again.created and again.pair_id == reg.pair_id
        assert await client.coefficients(reg.pair_id) == reg.coefficients
        x = features(16, k)
        conf, surv = await client.score(reg.pair_id, x)
        p = predict(core_coefficients(reg.coefficients), x)
        np.testing.assert_array_equal(conf, p.astype(np.float32))
        np.testing.assert_array_equal(surv, survival(p).astype(np.float32))
        await client.set_cost_curves(reg.pair_id, DRAFT, VERIFY)
        got = await client.budget(reg.pair_id, conf, [k] * 16, 16, 16, rule="full")
        assert got.budget == 16 * k and got.rule == "full"
        assert [p.pair_id for p in await client.pairs()] == [reg.pair_id]
        assert (await client.pair(reg.pair_id)).key.k == k
        with pytest.raises(NotFoundError):
            await client.coefficients("nope")
        with pytest.raises(InvalidArgumentError):
            await client.score(reg.pair_id, features(2, k + 1))

        updates: list[Coefficients] = []
        watcher = client.watch(reg.pair_id, updates.append)
        watch = client.watch(reg.pair_id)
        first = await watch.__anext__()
        assert first == reg.coefficients
        fwd = client.forwarder(reg.pair_id)
        for s in steps:
            fwd.submit(*s, None)
        second = await asyncio.wait_for(watch.__anext__(), 10)
        assert second.version == first.version + 1
        watch.cancel()
        await fwd.close()
        assert fwd.stats.acked == len(steps) and fwd.stats.pending == 0
        # the callback watcher is a stream of its own: wait for it (not a fixed 2 s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while len(updates) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.02)
        assert [u.version for u in updates] == [first.version, second.version]
        await watcher.cancel()


async def test_async_client_recreates_its_channel_on_a_new_pid(server):
    client = AsyncEstimatorClient(server.grpc_address)
    reg = await client.register("t", "d", "m", K)
    first = client._channel
    client._pid = -1
    assert await client.coefficients(reg.pair_id) == reg.coefficients
    assert client._channel is not first
    await first.close()
    await client.close()
