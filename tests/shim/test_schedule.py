"""Draft length by batch size (avest_client.vllm.schedule), without vLLM: the check against
vLLM's rules, the fetch through its seam bounded by the timeout, which value governs and
its one log line, and the wrap of ``EngineArgs.create_speculative_config``. Where vLLM's
source is at hand (as for the contract test), the check and the lookup are compared with
vLLM's own functions on many schedules."""

from __future__ import annotations

import logging
import os
import random
import threading
import types
from typing import Any

import pytest

from avest_client.vllm import schedule as sched
from avest_client.vllm.config import ConfigError, ShimConfig
from avest_client.vllm.contract_check import find_source
from avest_wire.pair import PairKey

LOGGER = "avest_client.vllm.schedule"
K = 4
GOOD = [(1, 8, 4), (9, 32, 2), (33, 256, 0)]


def spec(**overrides: Any) -> types.SimpleNamespace:
    values = {
        "model": "draft-1b",
        "method": "draft_model",
        "num_speculative_tokens": K,
        "draft_sample_method": "greedy",
        "num_speculative_tokens_per_batch_size": None,
    }
    return types.SimpleNamespace(**{**values, **overrides})


TARGET = types.SimpleNamespace(model="target-8b")
ONE_RANK = types.SimpleNamespace(data_parallel_size=1)
ON = ShimConfig(address="127.0.0.1:9", timeout_s=0.5, labels=(("domain", "code"),),
                hardware="H100", schedule=True)  # fmt: skip


class Recorder:
    """A real fetch: returns ``result`` (or raises it) and keeps what it was asked."""

    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[tuple[PairKey, str]] = []

    def __call__(self, pair: PairKey, hardware: str) -> Any:
        self.calls.append((pair, hardware))
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def run(caplog: pytest.LogCaptureFixture, fetch: Any, config: ShimConfig = ON,
        s: types.SimpleNamespace | None = None, parallel: Any = ONE_RANK,
        vllm_check: Any = None) -> tuple[types.SimpleNamespace, sched.Decision]:  # fmt: skip
    s = spec() if s is None else s
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        decision = sched.apply(s, TARGET, parallel, config, fetch, vllm_check)
    (record,) = lines(caplog)  # exactly one line, whatever governs
    assert record.getMessage() == decision.line
    return s, decision


# ------------------------------------------------------------------ the check


def test_check_accepts_vllm_schedules_and_sorts_them():
    assert sched.check_schedule(list(reversed(GOOD)), K) == GOOD
    assert sched.check_schedule([[1, 1, 0]], K) == [(1, 1, 0)]
    assert sched.check_schedule([(1, 4, 9)], K) == [(1, 4, 9)]  # vLLM caps it at K


@pytest.mark.parametrize(
    "bad",
    [
        [],
        None,
        "1,8,4",
        [(1, 8)],
        [(0, 8, 4)],
        [(2, 8, 4)],  # batch size 1 has no length
        [(1, 8, 4), (8, 16, 2)],  # overlap at 8
        [(1, 8, 4), (5, 6, 2)],
        [(1, 8, -1)],
        [(1, 8, 2.0)],
        [(1, 8, True)],
        [(3, 2, 1)],
    ],
)
def test_check_refuses(bad: Any):
    with pytest.raises(sched.ScheduleError):
        sched.check_schedule(bad, K)


def test_check_needs_k_of_at_least_one():
    with pytest.raises(sched.ScheduleError):
        sched.check_schedule(GOOD, 0)


def test_lookup_fills_gaps_and_the_tail_with_the_previous_length_capped_at_k():
    table = sched.lookup([(1, 2, 9), (5, 6, 1), (8, 8, 0)], 10, 3)
    assert table[1:] == [3, 3, 3, 3, 1, 1, 1, 0, 0, 0]


def vllm_functions() -> dict[str, Any] | None:
    """vLLM's own ``dynamic/utils.py`` (it imports nothing) from its source, if at hand."""
    source = find_source()
    if source is None:
        return None
    text = source.read("vllm/v1/spec_decode/dynamic/utils.py")
    if text is None:
        return None
    namespace: dict[str, Any] = {}
    exec(compile(text, "vllm/v1/spec_decode/dynamic/utils.py", "exec"), namespace)  # noqa: S102
    return namespace


def random_schedule(rng: random.Random) -> list[tuple[int, int, int]]:
    entries = []
    start = rng.choice([1, 1, 1, 2])
    for _ in range(rng.randint(1, 5)):
        end = start + rng.randint(-1, 20)
        entries.append((start, end, rng.randint(-1, 6)))
        start = end + rng.choice([-1, 1, 1, 1, 3])
    rng.shuffle(entries)
    return entries


def test_check_and_lookup_agree_with_vllm():
    """Same verdict as vLLM's check on 2,000 schedules, the same table where accepted."""
    ns = vllm_functions()
    if ns is None:
        if os.environ.get("AVEST_REQUIRE_VLLM_SOURCE") == "1":
            pytest.fail("vLLM's source not found (AVEST_VLLM_SOURCE)")
        pytest.skip("vLLM's source not found: set AVEST_VLLM_SOURCE to the 0.33 wheel")
    rng = random.Random(7)
    accepted = 0
    for _ in range(2000):
        schedule, k, max_batch = random_schedule(rng), rng.randint(1, 5), rng.randint(1, 64)
        try:
            theirs = ns["build_dynamic_sd_schedule_lookup"](schedule, max_batch, k)
        except ValueError:
            theirs = None
        try:
            ours = sched.lookup(sched.check_schedule(schedule, k), max_batch, k)
        except sched.ScheduleError:
            ours = None
        assert ours == theirs, (schedule, k, max_batch)
        accepted += ours is not None
    assert 200 < accepted < 1800  # both verdicts were exercised


# ------------------------------------------------------------------ who governs


def test_without_opt_in_the_configured_value_governs_and_nothing_is_fetched(caplog):
    fetch = Recorder(GOOD)
    s, decision = run(caplog, fetch, ShimConfig(address="127.0.0.1:9", hardware="H100"))
    assert decision.schedule is None and s.num_speculative_tokens_per_batch_size is None
    assert fetch.calls == []
    assert "configured" in decision.line and "AVEST_SCHEDULE is off" in decision.line
    assert lines(caplog)[0].levelno == logging.INFO


def test_opted_in_the_sidecars_schedule_is_set_for_the_pair_and_hardware(caplog):
    fetch = Recorder([list(e) for e in reversed(GOOD)])
    s, decision = run(caplog, fetch)
    assert s.num_speculative_tokens_per_batch_size == GOOD
    assert decision.schedule == GOOD and "sidecar's schedule governs" in decision.line
    ((pair, hardware),) = fetch.calls
    assert hardware == "H100"
    assert pair == PairKey(
        "target-8b",
        "draft-1b",
        "draft_model",
        K,
        {"domain": "code", "draft_sample_method": "greedy"},
    )


def test_the_sidecars_schedule_replaces_a_configured_one_and_says_so(caplog):
    s, decision = run(
        caplog, Recorder(GOOD), s=spec(num_speculative_tokens_per_batch_size=[(1, 4, 1)])
    )
    assert s.num_speculative_tokens_per_batch_size == GOOD
    assert "replacing the configured [(1, 4, 1)]" in decision.line


@pytest.mark.parametrize(
    ("result", "why"),
    [
        (OSError("connection refused"), "fetching the schedule failed: OSError"),
        (None, "no schedule for this pair"),
        ([(2, 8, 1)], "refused"),
        ([(1, 8, 1), (4, 9, 0)], "refused"),
        ({"ranges": []}, "refused"),
    ],
)
def test_on_failure_the_configured_value_governs(caplog, result: Any, why: str):
    configured = [(1, 16, 2)]
    s, decision = run(
        caplog, Recorder(result), s=spec(num_speculative_tokens_per_batch_size=configured)
    )
    assert decision.schedule is None and s.num_speculative_tokens_per_batch_size == configured
    assert why in decision.line and "the configured" in decision.line
    assert lines(caplog)[0].levelno == logging.WARNING


def test_a_hanging_fetch_is_bounded_by_the_timeout(caplog):
    release = threading.Event()

    def hangs(pair: PairKey, hardware: str) -> Any:
        release.wait()
        return GOOD

    try:
        s, decision = run(caplog, hangs)
    finally:
        release.set()
    assert decision.schedule is None and s.num_speculative_tokens_per_batch_size is None
    assert "TimeoutError: no schedule within 0.5 s" in decision.line


def test_vllms_own_check_refusing_leaves_the_configured_value(caplog):
    def refuses(schedule: Any, k: int) -> None:
        raise ValueError("not today")

    s, decision = run(caplog, Recorder(GOOD), vllm_check=refuses)
    assert decision.schedule is None and "not today" in decision.line


@pytest.mark.parametrize(
    ("config", "s", "parallel", "why"),
    [
        (ShimConfig(address="a:1", schedule=True), None, ONE_RANK, "needs AVEST_HARDWARE"),
        (ON, None, types.SimpleNamespace(data_parallel_size=2), "data parallelism"),
        (ON, types.SimpleNamespace(model="d", method="draft_model", num_speculative_tokens=K),
         ONE_RANK, "this vLLM has no num_speculative_tokens_per_batch_size"),
        (ON, spec(num_speculative_tokens=0), ONE_RANK, "must be >= 1"),
    ],
)  # fmt: skip
def test_what_vllm_would_not_take_is_not_fetched_or_set(caplog, config, s, parallel, why):
    fetch = Recorder(GOOD)
    s2, decision = run(caplog, fetch, config, s, parallel)
    assert decision.schedule is None and why in decision.line
    assert getattr(s2, "num_speculative_tokens_per_batch_size", None) is None
    assert fetch.calls == []


def test_no_source_leaves_the_configured_value(caplog):
    _, decision = run(caplog, None)
    assert decision.schedule is None and "no schedule source" in decision.line


# ------------------------------------------------------------------ the wrap


def fake_arg_utils() -> types.ModuleType:
    module = types.ModuleType("fake_arg_utils")

    class EngineArgs:
        def __init__(self, speculative: bool = True) -> None:
            self.speculative = speculative

        def create_speculative_config(self, target_model_config, target_parallel_config):  # noqa: ANN001, ANN201
            return spec() if self.speculative else None

    module.EngineArgs = EngineArgs  # type: ignore[attr-defined]
    return module


def test_install_wraps_create_speculative_config_once(caplog, monkeypatch):
    module = fake_arg_utils()
    fetch = Recorder(GOOD)
    assert sched.install(module, ON, fetch, vllm_check=None) is True
    assert sched.install(module, ON, fetch, vllm_check=None) is True  # idempotent: one wrap
    with caplog.at_level(logging.INFO, logger=LOGGER):
        made = module.EngineArgs().create_speculative_config(
            target_model_config=TARGET, target_parallel_config=ONE_RANK
        )
        assert (
            module.EngineArgs(speculative=False).create_speculative_config(TARGET, ONE_RANK) is None
        )
    assert made.num_speculative_tokens_per_batch_size == GOOD
    assert len(fetch.calls) == 1 and len(lines(caplog)) == 1


def test_install_reads_the_seam_at_each_call(caplog, monkeypatch):
    module = fake_arg_utils()
    sched.install(module, ON, vllm_check=None)
    monkeypatch.setattr(sched, "FETCH", Recorder([(1, 1, 1)]))
    made = module.EngineArgs().create_speculative_config(TARGET, ONE_RANK)
    assert made.num_speculative_tokens_per_batch_size == [(1, 1, 1)]


def test_install_without_the_method_leaves_vllm_alone():
    assert sched.install(types.ModuleType("empty"), ON) is False


def test_a_failing_decision_never_reaches_vllm(caplog, monkeypatch):
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(sched, "decide", boom)
    s, decision = run(caplog, Recorder(GOOD))
    assert decision.schedule is None and "RuntimeError: bug" in decision.line


def test_config_flag():
    assert ShimConfig.from_env({}).schedule is False
    for on in ("1", "true", " ON "):
        assert ShimConfig.from_env({"AVEST_SCHEDULE": on}).schedule is True
    for off in ("0", "no", ""):
        assert ShimConfig.from_env({"AVEST_SCHEDULE": off}).schedule is False
    with pytest.raises(ConfigError):
        ShimConfig.from_env({"AVEST_SCHEDULE": "maybe"})


def test_the_sidecars_schedule_governs_once_it_has_one(caplog, open_server):
    """No source set: the plugin asks the sidecar at AVEST_ADDRESS (GetSchedule) for the
    pair it derives from vLLM's config. Before the pair has enough evidence the
    configured value governs; after, the sidecar's schedule is what vLLM gets."""
    from avest_client import EstimatorClient
    from avest_client.vllm.pair import pair_from_vllm_config
    from avest_wire.v1 import estimator_pb2 as pb
    from tests.support.live import messages, observe
    from tests.support.traces import load_trace

    k = 5  # the bundled trace's
    live = open_server(min_refit_interval_ms=0)  # the version settles with the acks
    config = ShimConfig(address=live.grpc_address, timeout_s=10.0, hardware="H100", schedule=True)
    s = spec(num_speculative_tokens=k)
    holder = types.SimpleNamespace(model_config=TARGET, speculative_config=s)
    key = pair_from_vllm_config(holder, k, config.labels)
    with EstimatorClient(live.grpc_address) as client:
        reg = client.register(key.target, key.draft, key.method, k, dict(key.labels))
        assert reg.pair_id == key.pair_id
        live.stub.SetCostCurves(
            pb.SetCostCurvesRequest(
                pair_id=reg.pair_id,
                hardware="H100",
                draft_curve=[pb.CostPoint(size=1, ms=0.2), pb.CostPoint(size=512, ms=0.4)],
                verify_curve=[pb.CostPoint(size=n, ms=5.0 + 0.5 * (n - 1)) for n in (1, 2, 4096)],
                cudagraph_capture_limit=1,
            ),
            timeout=10,
        )
        module = fake_arg_utils()
        module.EngineArgs.create_speculative_config = lambda self, t, p: s  # type: ignore[attr-defined]
        assert sched.install(module, config, vllm_check=None)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            made = module.EngineArgs().create_speculative_config(TARGET, ONE_RANK)
        assert made.num_speculative_tokens_per_batch_size is None
        (line,) = lines(caplog)
        assert "configured" in line.getMessage() and "no schedule" in line.getMessage()
        observe(live, messages(load_trace("sample"), reg.pair_id))
        want = client.schedule(reg.pair_id, "H100").to_vllm()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        made = module.EngineArgs().create_speculative_config(TARGET, ONE_RANK)
    assert made.num_speculative_tokens_per_batch_size == want
    assert len({length for _, _, length in want}) >= 2  # lengths differ by batch size
    (line,) = lines(caplog)
    assert "the sidecar's schedule governs" in line.getMessage()
