"""Forwarders against a real server: exact learning, never blocking, exact drops,
reconnects that resend without applying anything twice, refused steps."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from avest.core.estimator import OnlineEstimator
from avest_client import AsyncEstimatorClient, Backoff, EstimatorClient, Forwarder
from tests.support.helpers import free_port, wait_until
from tests.support.serve import serve_subprocess, stop_process
from tests.support.traces import core_replay

FAST = Backoff(initial_s=0.02, max_s=0.2)
TARGET, DRAFT, METHOD = "target/model", "draft/model", "draft_model"


def server_state(handle, pair_id: str) -> dict:
    async def snap() -> dict:
        est = handle.server.app.registry.get(pair_id).estimator
        return {
            "arrays": {n: np.array(v, copy=True) for n, v in est.snapshot().items()},
            "version": est.version,
            "round": est.round,
            "steps": est.steps,
            "drafts": est.drafts,
        }

    return handle.call(snap)


def assert_equals_replay(state: dict, est: OnlineEstimator) -> None:
    """Server estimator == in-process replay: coefficients to 1e-12, counts exactly."""
    assert (state["steps"], state["drafts"]) == (est.steps, est.drafts)
    assert (state["version"], state["round"]) == (est.version, est.round)
    want = est.snapshot()
    assert state["arrays"].keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(state["arrays"][name], value, rtol=0, atol=1e-12, err_msg=name)


def submit_all(fwd, steps) -> None:
    for x, d, a in steps:
        fwd.submit(x, d, a, None)


@pytest.mark.parametrize("rule", ["vllm", "recursive", "tracking"])
def test_a_forwarded_trace_gives_the_in_process_replay_exactly(server, chat_steps, rule):
    k, steps = chat_steps(0, 200)
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, rule=rule, refit_interval=20)
        fwd = client.forwarder(reg.pair_id, k=k)
        submit_all(fwd, steps)
        assert fwd.flush(timeout=30)
        assert fwd.connected
        latest = fwd.latest_coefficients()
        fwd.close()
        assert not fwd.connected
        info = client.pair(reg.pair_id)
    est = core_replay(steps, k, rule, 20, server.settings)
    assert_equals_replay(server_state(server, reg.pair_id), est)
    s = fwd.stats
    assert (s.submitted, s.sent, s.acked, s.acked_sequence) == (200, 200, 200, 200)
    assert (s.dropped, s.refused, s.resent, s.reconnects, s.pending) == (0, 0, 0, 0, 0)
    assert info.steps_observed == 200 and info.drafts_observed == est.drafts
    assert latest is not None
    assert (latest.version, latest.slope, latest.intercepts) == (
        est.version,
        est.coefficients.slope,
        tuple(est.coefficients.intercepts),
    )


async def test_the_async_forwarder_gives_the_replay_too(server, chat_steps):
    k, steps = chat_steps(0, 120)
    async with AsyncEstimatorClient(server.grpc_address) as client:
        reg = await client.register(TARGET, DRAFT, METHOD, k, rule="recursive", refit_interval=15)
        fwd = client.forwarder(reg.pair_id)
        submit_all(fwd, steps)
        assert await fwd.flush(timeout=30)
        latest = fwd.latest_coefficients()
        await fwd.close()
    est = core_replay(steps, k, "recursive", 15, server.settings)
    assert_equals_replay(server_state(server, reg.pair_id), est)
    assert (fwd.stats.acked, fwd.stats.dropped) == (120, 0)
    assert latest is not None and latest.version == est.version


def test_submit_never_blocks_and_drops_the_oldest_exactly_while_the_server_is_absent():
    k, rows, n, queue = 8, 64, 5000, 100
    port = free_port()
    fwd = Forwarder(f"127.0.0.1:{port}", "0123456789abcdef", queue_size=queue, backoff=FAST)
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, size=(rows, k)).astype(np.float32)
    d = np.full(rows, k, dtype=np.int32)
    a = rng.integers(0, k + 1, size=rows).astype(np.int32)
    worst = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        fwd.submit(x, d, a, None)
        worst = max(worst, time.perf_counter() - t)
    total = time.perf_counter() - t0
    s = fwd.stats
    assert (s.submitted, s.dropped, s.pending, s.sent) == (n, n - queue, queue, 0)
    assert fwd.sequences() == ([], list(range(n - queue + 1, n + 1)))
    assert not fwd.connected
    # Never waits on the network: the bound is far above any scheduling stall
    # of a loaded box and far below a connect attempt's backoff. What a submit
    # costs is a benchmark (bench/bench_shim.py), not an assertion here.
    assert worst < 1.0, f"slowest submit {worst * 1e3:.1f} ms (total {total:.2f} s)"
    t = time.perf_counter()
    fwd.close(timeout=0.3)
    assert time.perf_counter() - t < 5.0  # gives up at the deadline
    assert fwd.stats.pending == queue


def test_queued_steps_reach_a_server_that_comes_up_later(start_server, tmp_path, chat_steps):
    k, steps = chat_steps(0, 150)
    queue = 40
    first = start_server(tmp_path)  # registers the pair, so it exists when the forwarder connects
    with EstimatorClient(first.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, rule="vllm", refit_interval=10)
    first.stop()
    port = free_port()
    fwd = Forwarder(f"127.0.0.1:{port}", reg.pair_id, queue_size=queue, backoff=FAST)
    submit_all(fwd, steps)
    assert fwd.stats.dropped == len(steps) - queue
    srv = start_server(tmp_path, grpc_address=f"127.0.0.1:{port}")
    assert fwd.flush(timeout=30)
    fwd.close()
    s = fwd.stats
    assert (s.acked, s.dropped, s.acked_sequence) == (queue, len(steps) - queue, len(steps))
    # The server learned exactly the steps that were kept: the last `queue`.
    est = core_replay(steps[-queue:], k, "vllm", 10, srv.settings)
    assert_equals_replay(server_state(srv, reg.pair_id), est)


def _stream_in_background(fwd, steps, pause_s=0.002):
    done = threading.Event()

    def run():
        for x, d, a in steps:
            fwd.submit(x, d, a, None)
            time.sleep(pause_s)
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


@pytest.mark.slow
def test_a_restarted_server_gets_every_unacknowledged_step_once(start_server, tmp_path, chat_steps):
    """Graceful stop mid-stream, start again on the same port and data directory."""
    k, steps = chat_steps(0, 240)
    srv = start_server(tmp_path)
    port = srv.grpc_port
    with EstimatorClient(srv.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, rule="recursive", refit_interval=25)
    fwd = Forwarder(srv.grpc_address, reg.pair_id, backoff=FAST)
    thread, done = _stream_in_background(fwd, steps)
    assert wait_until(lambda: fwd.stats.acked >= 60, 20)
    srv.stop()  # mid-stream: the submitter keeps going
    assert wait_until(lambda: not fwd.connected, 10)
    time.sleep(0.2)
    srv = start_server(tmp_path, grpc_address=f"127.0.0.1:{port}")
    thread.join(30)
    assert done.is_set()
    assert fwd.flush(timeout=30)
    fwd.close()
    s = fwd.stats
    assert (s.submitted, s.acked, s.dropped, s.refused) == (240, 240, 0, 0)
    assert s.reconnects >= 1
    est = core_replay(steps, k, "recursive", 25, srv.settings)
    assert_equals_replay(server_state(srv, reg.pair_id), est)


def test_lost_acks_mean_resends_that_the_server_ignores(start_server, tmp_path, chat_steps):
    """The streams die without their acks (as in a crash after the snapshot): the
    forwarder resends steps the server already applied; nothing counts twice."""
    k, steps = chat_steps(0, 150)
    # No periodic flush: acknowledgements only follow the refit every 25 steps.
    srv = start_server(tmp_path, flush_interval_ms=600_000)
    port = srv.grpc_port
    with EstimatorClient(srv.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, rule="vllm", refit_interval=25)
        fwd = Forwarder(srv.grpc_address, reg.pair_id, backoff=FAST)
        submit_all(fwd, steps[:50])  # the refit at 50 flushes: acknowledged up to 50
        assert wait_until(lambda: fwd.stats.acked_sequence == 50, 20)
        submit_all(fwd, steps[50:60])  # applied, but nothing flushes before step 75
        assert wait_until(lambda: client.pair(reg.pair_id).steps_observed == 60, 20)
    assert fwd.stats.acked_sequence == 50
    assert fwd.sequences()[0] == list(range(51, 61))  # applied, not acknowledged
    srv.kill_streams()  # every stream cancelled: acks for 51..60 never sent
    srv.stop()  # final snapshot: 51..60 are durable
    submit_all(fwd, steps[60:100])
    srv = start_server(tmp_path, grpc_address=f"127.0.0.1:{port}")
    submit_all(fwd, steps[100:])
    assert fwd.flush(timeout=30)
    fwd.close()
    s = fwd.stats
    # Resending starts at 51 (on a stream that reached the server before it
    # stopped); on the restarted server's stream the answer to the opening says
    # 51..60 are durable and releases whatever is left before it goes out again.
    assert 0 <= s.resent <= 10 and s.reconnects >= 1
    assert s.sent == 150 + s.resent
    assert (s.submitted, s.acked, s.dropped, s.refused, s.pending) == (150, 150, 0, 0, 0)
    est = core_replay(steps, k, "vllm", 25, srv.settings)
    assert_equals_replay(server_state(srv, reg.pair_id), est)


def test_the_unacknowledged_window_is_bounded(start_server, tmp_path, chat_steps):
    k, steps = chat_steps(0, 50)
    srv = start_server(tmp_path, flush_interval_ms=600_000)
    with EstimatorClient(srv.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, refit_interval=1000)
        fwd = client.forwarder(reg.pair_id, max_unacked=10)
        submit_all(fwd, steps)
        assert wait_until(lambda: client.pair(reg.pair_id).steps_observed == 50, 20)
        assert fwd.sequences() == (list(range(41, 51)), [])
        fwd.close(timeout=10)  # half-close: the server flushes and acknowledges
    s = fwd.stats
    assert (s.sent, s.dropped, s.acked, s.pending) == (50, 40, 10, 0)


def test_a_refused_step_is_dropped_and_the_rest_goes_on(server, chat_steps):
    k, steps = chat_steps(0, 60)
    bad = (np.zeros((3, k + 1), dtype=np.float32), np.ones(3), np.ones(3))
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, rule="vllm", refit_interval=10)
        # Without k= the forwarder cannot catch the wrong K: the server refuses it.
        fwd = client.forwarder(reg.pair_id, backoff=FAST)
        submit_all(fwd, steps[:30])
        fwd.submit(*bad, None)  # sequence 31
        submit_all(fwd, steps[30:])
        assert fwd.flush(timeout=30)
        fwd.close()
    s = fwd.stats
    assert (s.submitted, s.refused, s.acked, s.dropped, s.acked_sequence) == (61, 1, 60, 0, 61)
    assert re.match(r"INVALID_ARGUMENT: sequence 31 of worker .*: k: ", fwd.last_error)
    est = core_replay(steps, k, "vllm", 10, server.settings)
    assert_equals_replay(server_state(server, reg.pair_id), est)


def test_steps_for_an_unknown_pair_are_refused_one_by_one_without_looping(server, chat_steps):
    k, steps = chat_steps(0, 5)
    fwd = Forwarder(server.grpc_address, "no-such-pair", backoff=FAST)
    submit_all(fwd, steps)
    assert wait_until(lambda: fwd.stats.refused == 5, 20)
    fwd.close(timeout=1)
    assert fwd.stats.pending == 0 and fwd.stats.acked == 0
    # Each stream's opening is refused, and stands for the oldest step held.
    assert re.match(r"NOT_FOUND: opening worker .*: unknown pair_id", fwd.last_error)


def test_bad_steps_are_refused_locally_without_raising(server):
    fwd = Forwarder(server.grpc_address, "p", k=4)
    fwd.submit(np.zeros((2, 5), np.float32), [1, 1], [0, 0], None)  # K
    fwd.submit(np.zeros((2, 4), np.float32), [1], [0], None)  # rows
    fwd.submit(np.full((2, 4), np.nan, np.float32), [1, 1], [0, 0], None)
    fwd.submit(np.zeros((2, 4), np.float32), [1, 1], [2, 0], None)  # accepted > verified
    fwd.submit(np.zeros(4, np.float32), [1], [0], None)
    fwd.submit(np.zeros((2, 4), np.float32), [1, 1], [0, 0], [True])
    s = fwd.stats
    assert (s.invalid, s.submitted, s.pending) == (6, 0, 0)
    assert "exclude" in fwd.last_invalid
    fwd.close()


def test_forwarders_implement_the_shim_sink_protocol():
    from avest_client.vllm.sink import Sink

    assert isinstance(Forwarder("127.0.0.1:1", "p"), Sink)


def test_default_worker_ids_are_unique_per_incarnation():
    a = Forwarder("127.0.0.1:1", "p")
    b = Forwarder("127.0.0.1:1", "p")
    assert a.worker_id != b.worker_id
    host, pid, rand = a.worker_id.rsplit(":", 2)
    assert int(pid) == os.getpid() and len(rand) == 8 and host
    assert Forwarder("127.0.0.1:1", "p", worker_id="w").worker_id == "w"


def test_a_changed_pid_gives_the_forwarder_a_fresh_start(server, chat_steps):
    """As after fork: a new worker id, an empty ledger and a sender of its own."""
    k, steps = chat_steps(0, 20)
    with EstimatorClient(server.grpc_address) as client:
        reg = client.register(TARGET, DRAFT, METHOD, k, refit_interval=1000)
        fwd = client.forwarder(reg.pair_id)
        submit_all(fwd, steps[:10])
        assert fwd.flush(10)
        parent = (fwd.worker_id, fwd._thread, fwd._driver)
        fwd._pid = -1  # as if this process were a fork of the one that started it
        submit_all(fwd, steps[10:])
        assert fwd.flush(10)
        assert fwd.worker_id != parent[0] and fwd._thread is not parent[1]
        assert (fwd.stats.submitted, fwd.stats.acked, fwd.stats.acked_sequence) == (10, 10, 10)
        parent[2].cancel()  # the "parent's" sender, still running in this process
        fwd.close()
        assert client.pair(reg.pair_id).steps_observed == 20


FORK_SCRIPT = """
import os, sys
import numpy as np
from avest_client import EstimatorClient

address = sys.argv[1]
rng = np.random.default_rng(0)
step = (rng.normal(0, 2, (4, 5)).astype(np.float32), np.full(4, 5), np.full(4, 2))
client = EstimatorClient(address, timeout=10)
reg = client.register("fork/target", "fork/draft", "m", 5, refit_interval=1000)
fwd = client.forwarder(reg.pair_id)  # lazy: no thread, no stream before the fork
parent_worker = fwd.worker_id
pid = os.fork()
if pid == 0:
    status = 3
    try:
        assert client.coefficients(reg.pair_id) == reg.coefficients  # its own channel
        for _ in range(10):
            fwd.submit(*step, None)
        assert fwd.flush(20), fwd.stats
        assert fwd.worker_id != parent_worker
        assert (fwd.stats.acked, fwd.stats.acked_sequence) == (10, 10), fwd.stats
        fwd.close()
        status = 0
    except BaseException as exc:
        print("child:", repr(exc), flush=True)
    finally:
        os._exit(status)
_, code = os.waitpid(pid, 0)
assert os.WEXITSTATUS(code) == 0, code
for _ in range(7):
    fwd.submit(*step, None)
assert fwd.flush(20) and fwd.worker_id == parent_worker and fwd.stats.acked == 7
client.close()
assert client.__class__(address).pair(reg.pair_id).steps_observed == 17
print("ok")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.slow
def test_a_client_and_forwarder_built_before_fork_work_in_the_child(subprocess_server):
    """The vLLM pattern: built in the parent (no call in flight), used after fork.

    Run in a fresh interpreter: gRPC does not survive a fork taken while its
    threads are busy, and this test process runs grpc.aio servers.
    """
    out = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, subprocess_server],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.mark.slow
def test_sigkill_mid_stream_loses_nothing_and_applies_nothing_twice(tmp_path, chat_steps):
    k, steps = chat_steps(0, 300)
    proc, address = serve_subprocess(tmp_path)
    port = int(address.rsplit(":", 1)[1])
    try:
        with EstimatorClient(address) as client:
            reg = client.register(TARGET, DRAFT, METHOD, k, rule="recursive", refit_interval=20)
        fwd = Forwarder(address, reg.pair_id, backoff=FAST)
        thread, done = _stream_in_background(fwd, steps)
        assert wait_until(lambda: fwd.stats.acked >= 80, 30)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        acked_before = fwd.stats.acked_sequence
        proc, address = serve_subprocess(tmp_path, port)
        thread.join(60)
        assert done.is_set() and fwd.flush(timeout=30)
        fwd.close()
        with EstimatorClient(address) as client:
            info = client.pair(reg.pair_id)
    finally:
        stop_process(proc, 15)
    s = fwd.stats
    assert acked_before >= 80
    assert (s.submitted, s.acked, s.dropped, s.refused) == (300, 300, 0, 0)
    assert s.reconnects >= 1
    from avest.settings import Settings

    est = core_replay(steps, k, "recursive", 20, Settings())
    assert (info.steps_observed, info.drafts_observed) == (300, est.drafts)
    assert (info.coefficients.version, info.coefficients.round) == (est.version, est.round)
    np.testing.assert_allclose(info.coefficients.slope, est.coefficients.slope, rtol=0, atol=1e-12)
    np.testing.assert_allclose(
        info.coefficients.intercepts, est.coefficients.intercepts, rtol=0, atol=1e-12
    )
