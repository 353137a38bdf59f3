"""Plugin registration, configuration, import hooks and the vLLM-side hooks, without vLLM."""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from importlib.metadata import entry_points

import pytest
import torch

from avest_client.vllm import costs, exclusion, plugin
from avest_client.vllm.config import ConfigError, ShimConfig, parse_labels
from avest_client.vllm.hooks import _FINDER, when_imported
from avest_client.vllm.pair import pair_from_vllm_config
from avest_client.vllm.sidecar import sink as sidecar_sink
from avest_wire.pair import PairKey
from tests.support.standin import StandinAcceptanceEstimator

from .fakes import FakeSink


def test_entry_point_is_declared():
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "avest"]
    assert len(eps) == 1 and eps[0].value == "avest_client.vllm.plugin:register"
    assert eps[0].load() is plugin.register


def test_config_from_env():
    assert ShimConfig.from_env({}) == ShimConfig()
    assert not ShimConfig.from_env({}).enabled
    cfg = ShimConfig.from_env(
        {
            "AVEST_ADDRESS": " 10.0.0.5:7070 ",
            "AVEST_TIMEOUT_S": "2.5",
            "AVEST_QUEUE_SIZE": "128",
            "AVEST_LABELS": "temp=0.7, domain=code,",
            "AVEST_SYNC_STEPS": "32",
        }
    )
    assert cfg == ShimConfig("10.0.0.5:7070", 2.5, 128, (("domain", "code"), ("temp", "0.7")), 32)
    assert cfg.enabled
    assert ShimConfig.from_env({"AVEST_ROUND_STEPS": "500"}).round_steps == 500
    for bad in (
        {"AVEST_ROUND_STEPS": "-1"},
        {"AVEST_ROUND_STEPS": "10001"},
        {"AVEST_ROUND_STEPS": "1.5"},
        {"AVEST_QUEUE_SIZE": "0"},
        {"AVEST_QUEUE_SIZE": "many"},
        {"AVEST_TIMEOUT_S": "-1"},
        {"AVEST_TIMEOUT_S": "nan"},
        {"AVEST_SYNC_STEPS": "0"},
        {"AVEST_LABELS": "novalue"},
        {"AVEST_LABELS": "a=1,a=2"},
        {"AVEST_LABELS": "bad key=1"},
    ):
        with pytest.raises(ConfigError):
            ShimConfig.from_env(bad)
    assert parse_labels("") == ()


def test_pair_from_vllm_config():
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model="meta-llama/Llama-3.1-8B-Instruct"),
        speculative_config=types.SimpleNamespace(
            model="yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
            method="eagle3",
            draft_sample_method="probabilistic",
        ),
    )
    key = pair_from_vllm_config(cfg, 5, (("temp", "1.0"),))
    assert key == PairKey(
        "meta-llama/Llama-3.1-8B-Instruct",
        "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B",
        "eagle3",
        5,
        (("draft_sample_method", "probabilistic"), ("temp", "1.0")),
    )
    assert pair_from_vllm_config(None, 3, ()) == PairKey("", "", "", 3)


def test_register_is_inert_without_address(monkeypatch):
    monkeypatch.delenv("AVEST_ADDRESS", raising=False)
    before = list(sys.meta_path)
    plugin.register()
    assert sys.meta_path == before


def test_register_without_vllm_touches_nothing(monkeypatch, caplog):
    monkeypatch.setenv("AVEST_ADDRESS", "127.0.0.1:1")
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    before = list(sys.meta_path)
    plugin.register()
    assert sys.meta_path == before
    assert "vLLM is not installed" in caplog.text


def test_register_with_bad_config_touches_nothing(monkeypatch, caplog):
    monkeypatch.setenv("AVEST_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("AVEST_QUEUE_SIZE", "-3")
    plugin.register()
    assert "plugin inactive" in caplog.text


def test_register_patches_the_speculator_name(fake_vllm, monkeypatch):
    sink = FakeSink(connected=False)
    calls = []

    def make_sink(config, pair_key):
        calls.append((config, pair_key))
        return sink

    monkeypatch.setattr(sidecar_sink, "make_sink", make_sink)
    monkeypatch.setenv("AVEST_MODE", "raw")  # every step to the sink (summary is the default)
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once
    shim = fake_vllm.spec.OnlineAcceptanceEstimator
    assert shim.__avest_shim__ and shim.__avest_base__ is StandinAcceptanceEstimator
    assert issubclass(shim, StandinAcceptanceEstimator)
    # the speculator builds it exactly as vLLM 0.33 does
    est = shim(16, 3, torch.device("cpu"))
    ((config, pair),) = calls
    assert config.address == "127.0.0.1:7070" and config.labels == (("temp", "1.0"),)
    assert pair.k == 3 and pair.labels == {"temp": "1.0"}
    est.step(torch.tensor([1]), torch.tensor([2]), torch.tensor([0]))
    assert est._avest.transfer.flush(5) and len(sink.snapshot()) == 1
    assert est._avest.transfer.exclusion is exclusion.REGISTRY
    # request flags and cost curves are recorded through the wrapped vLLM methods
    sampler = fake_vllm.sampler.Sampler()
    sampler.add_request(4, types.SimpleNamespace(presence_penalty=0.5))
    assert sampler.added == [4] and exclusion.REGISTRY.active
    mask = exclusion.REGISTRY.current()
    assert mask[4] and not mask[3] and not mask.flags.writeable
    mgr = fake_vllm.av.AdaptiveVerificationManager()
    mgr.set_cost_curves([(1, 0.5), (8, 0.9)], [(16, 3.0)])
    assert mgr.tables == ([(1, 0.5), (8, 0.9)], [(16, 3.0)])
    assert costs.RECORDER.latest() == ([(1, 0.5), (8, 0.9)], [(16, 3.0)])
    est.avest_close()


def test_production_path_without_network_sink_is_plain_vllm(fake_vllm, caplog):
    plugin.register()
    est = fake_vllm.spec.OnlineAcceptanceEstimator(8, 2, torch.device("cpu"))
    assert "no sink" in caplog.text
    assert est._avest.sink is None and est._avest.transfer is None
    est.step(torch.tensor([0]), torch.tensor([1]), torch.tensor([0]))


def test_contract_mismatch_leaves_vllm_untouched(fake_vllm, caplog):
    class Drifted(StandinAcceptanceEstimator):
        def step(self, idx_mapping, num_sampled, num_rejected, num_bonus):  # a new parameter
            raise AssertionError

    fake_vllm.spec.OnlineAcceptanceEstimator = Drifted
    plugin.register()
    assert fake_vllm.spec.OnlineAcceptanceEstimator is Drifted
    assert "does not match the contract" in caplog.text


def test_when_imported_waits_for_the_real_import(tmp_path, monkeypatch):
    pkg = tmp_path / "avest_hooktest_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "spec.py").write_text("VALUE = 41\n\n\ndef f():\n    return VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def cb(m):
        m.VALUE += 1
        seen.append(m.__name__)

    def broken(m):
        raise RuntimeError("a failing hook must not break the import")

    when_imported("avest_hooktest_pkg.spec", broken)
    when_imported("avest_hooktest_pkg.spec", cb)
    assert seen == []
    try:
        mod = importlib.import_module("avest_hooktest_pkg.spec")
        assert seen == ["avest_hooktest_pkg.spec"] and mod.f() == 42
        assert "return VALUE" in inspect.getsource(mod)  # loader still serves its source
        when_imported("avest_hooktest_pkg.spec", cb)  # already imported: runs at once
        assert mod.VALUE == 43
        assert "avest_hooktest_pkg.spec" not in _FINDER.pending
    finally:
        sys.modules.pop("avest_hooktest_pkg.spec", None)
        sys.modules.pop("avest_hooktest_pkg", None)


def test_exclusion_rule():
    ns = types.SimpleNamespace
    assert not exclusion.transforms_target_sampling(ns())
    assert not exclusion.transforms_target_sampling(ns(temperature=0.3, top_p=0.8, top_k=20))
    for kw in (
        {"repetition_penalty": 1.1},
        {"frequency_penalty": 0.2},
        {"presence_penalty": -0.1},
        {"allowed_token_ids": [3]},
        {"logit_bias": {3: 1.0}},
        {"bad_words": ["x"]},
        {"bad_words_token_ids": [[9]]},
        {"structured_outputs": object()},
    ):
        assert exclusion.transforms_target_sampling(ns(**kw)), kw
    reg = exclusion.ExclusionRegistry()
    reg.record(600, ns(presence_penalty=1.0))  # grows past the initial size
    before = reg.current()
    assert before.sum() == 1 and before[600]
    reg.record(600, ns(presence_penalty=1.0))  # unchanged flag: same array, no copy
    assert reg.current() is before
    reg.record(600, ns())  # copy-on-write: a snapshot taken earlier never changes
    assert before[600] and not reg.current()[600]
