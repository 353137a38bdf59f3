"""The snapshot blob's archive: written directly, read by ``np.load`` like ``np.savez``'s."""

from __future__ import annotations

import io

import numpy as np

from avest.core.estimator import OnlineEstimator, make_batch
from avest.core.rule_factory import make_rule
from avest.core.summary import summarise
from avest.state.store_format import npz_bytes, pack_arrays, unpack_arrays


def _steps(n: int, k: int = 5) -> list:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        d = rng.integers(0, k + 1, 16)
        out.append(
            make_batch(rng.normal(1, 2, (16, k)), d, np.minimum(rng.integers(0, k + 1, 16), d), k)
        )
    return out


def _arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    square = rng.normal(size=(5, 7))
    return {
        "float64": rng.normal(size=(3, 4)),
        "float32": rng.normal(size=(2, 3, 4)).astype(np.float32),
        "fortran": np.asfortranarray(square),
        "strided": square[:, ::2],
        "transposed": square.T,
        "scalar": np.array(3.5),
        "empty": np.zeros((4, 2, 0), dtype=np.float32),
        "ints": np.arange(6, dtype=np.int64),
        "bools": rng.random(5) < 0.5,
    }


def _load(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {name: npz[name] for name in npz.files}


def test_the_archive_loads_as_np_savez_writes_it():
    arrays = _arrays()
    reference = io.BytesIO()
    np.savez(reference, **arrays)
    ours, theirs = _load(npz_bytes(arrays)), _load(reference.getvalue())
    assert list(ours) == list(theirs) == list(arrays)
    for name, value in arrays.items():
        assert ours[name].dtype == theirs[name].dtype == value.dtype, name
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_an_estimator_snapshot_round_trips_through_a_blob():
    est = OnlineEstimator(5, make_rule("tracking"), refit_interval=8, calibrate=True)
    steps = _steps(40)
    for i in range(0, 40, 4):
        part = [(b.features, b.observed, b.accepted) for b in steps[i : i + 4]]
        est.apply_summary(summarise(part, est.coefficients, est.version))
    arrays = est.snapshot()
    back = unpack_arrays(pack_arrays(arrays))
    assert set(back) == set(arrays)
    for name, value in arrays.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
    again = OnlineEstimator(5, make_rule("tracking"), refit_interval=8, calibrate=True)
    again.restore(back)
    assert again.coefficients == est.coefficients
    assert again.calibration.summary() == est.calibration.summary()
