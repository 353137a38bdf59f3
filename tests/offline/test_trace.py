"""avest-trace/1: reading the shared traces, round trips, and every validation error."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from avest.core.numeric import sigmoid
from avest.offline.trace import (
    FORMAT,
    Trace,
    TraceError,
    bundled_sample_path,
    read_trace,
    write_trace,
)

# TRACE.md: rows, labelled drafts, share accepted (as printed, to the percent), K.
STATED = {
    "chat": (9_544, 26_726, 0.71, 5),
    "code": (4_782, 15_311, 0.75, 6),
}


@pytest.mark.parametrize("name", sorted(STATED))
def test_shared_traces_match_trace_md(trace_slice, name):
    trace = trace_slice(name, 0, None)
    rows, labelled, rate, k = STATED[name]
    assert trace.rows == rows
    assert trace.k == k == trace.meta["num_speculative_tokens"]
    assert trace.labelled_count() == labelled
    obs, acc = trace.labels()
    assert obs.sum() == labelled
    assert (acc & obs).sum() == trace.accepted_count()
    assert round(trace.accepted_count() / labelled, 2) == rate
    assert (trace.num_verified == k).all()  # recorded without trimming
    assert trace.meta["format"] == FORMAT
    assert trace.features.dtype == np.float32 and trace.num_verified.dtype == np.int32
    assert trace.step.dtype == np.int64 and trace.request.dtype == np.int64
    assert set(trace.optional_arrays()) == {
        "logit_q_sampled",
        "accept_prob_token",
        "accept_rate_dist",
    }


def test_chat_trace_steps(trace_slice):
    trace = trace_slice("chat", 0, None)
    assert trace.num_steps == 798
    sizes = [s.rows for s in trace.steps()]
    assert sum(sizes) == trace.rows
    assert max(sizes) <= trace.meta["batch"] == 16


def test_steps_iterate_contiguous_batches_in_order(sample_trace):
    seen = []
    total = 0
    for batch in sample_trace.steps():
        assert batch.rows > 0
        assert (batch.step == batch.step[0]).all()
        assert len(set(batch.request.tolist())) == batch.rows
        seen.append(int(batch.step[0]))
        total += batch.rows
    assert seen == sorted(set(sample_trace.step.tolist()))
    assert total == sample_trace.rows
    assert len(seen) == sample_trace.num_steps == 200


def test_slice_steps_and_head(sample_trace):
    part = sample_trace.slice_steps(10, 20)
    assert part.num_steps == 10
    assert part.step[0] == 10 and part.step[-1] == 19
    np.testing.assert_array_equal(
        part.features, sample_trace.features[sample_trace.step // 10 == 1]
    )
    assert sample_trace.slice_steps(-5).num_steps == 5
    assert sample_trace.slice_steps(150, 10).rows == 0
    assert sample_trace.head(0.25).num_steps == 50
    assert sample_trace.head(1.0).rows == sample_trace.rows
    assert sample_trace.head(0.0).rows == 0
    assert part.accept_rate_dist is not None and part.accept_rate_dist.shape == part.features.shape
    with pytest.raises(ValueError):
        sample_trace.head(1.5)


def test_trace_slice_fixture(trace_slice):
    assert trace_slice().num_steps == 200
    assert trace_slice("sample", 0, 3).num_steps == 3
    chat = trace_slice("chat", 0, 200)
    sample = trace_slice("sample")
    np.testing.assert_array_equal(chat.features, sample.features)
    np.testing.assert_array_equal(chat.num_accepted, sample.num_accepted)
    np.testing.assert_array_equal(chat.request, sample.request)
    np.testing.assert_array_equal(chat.accept_rate_dist, sample.accept_rate_dist)


def test_bundled_sample():
    path = bundled_sample_path()
    assert path.is_file() and path.stat().st_size < 300_000
    trace = read_trace(path)
    assert trace.k == 5 and trace.num_steps == 200
    assert trace.meta["source"] == "chat-rtn4g32-t1.0-k5.npz"
    assert "first 200 decode steps" in trace.meta["note"]
    assert trace.logit_q_sampled is not None and trace.accept_rate_dist is not None


# --- round trip ----------------------------------------------------------------


def assert_same(a: Trace, b: Trace) -> None:
    assert a.meta == b.meta
    for name, value in a.arrays().items():
        other = b.arrays()[name]
        assert value.dtype == other.dtype, name
        np.testing.assert_array_equal(value, other, err_msg=name)
    assert set(a.optional_arrays()) == set(b.optional_arrays())


@pytest.mark.parametrize("name", ["sample", "chat", "code"])
@pytest.mark.parametrize("compress", [True, False])
def test_round_trip(tmp_path, trace_slice, name, compress):
    trace = trace_slice(name, 0, None)
    path = write_trace(tmp_path / "t.npz", trace, compress=compress)
    assert path == tmp_path / "t.npz"
    assert_same(read_trace(path), trace)


def test_round_trip_without_optional_arrays_and_odd_name(tmp_path, sample_trace):
    bare = replace(
        sample_trace, logit_q_sampled=None, accept_prob_token=None, accept_rate_dist=None
    )
    path = write_trace(tmp_path / "bare.trace", bare)
    assert path.name == "bare.trace"  # no ".npz" appended
    back = read_trace(path)
    assert back.optional_arrays() == {}
    assert_same(back, bare)
    assert [p.name for p in tmp_path.iterdir()] == ["bare.trace"]


def test_write_refuses_invalid_trace_and_leaves_nothing(tmp_path, sample_trace):
    bad = replace(sample_trace, num_accepted=sample_trace.num_verified + 1)
    with pytest.raises(TraceError) as info:
        write_trace(tmp_path / "bad.npz", bad)
    assert info.value.array == "num_accepted"
    unserialisable = replace(sample_trace, meta={**sample_trace.meta, "x": object()})
    with pytest.raises(TraceError) as info:
        write_trace(tmp_path / "bad.npz", unserialisable)
    assert info.value.array == "meta"
    assert list(tmp_path.iterdir()) == []


def test_validate_converts_dtypes(sample_trace):
    loose = replace(
        sample_trace,
        features=sample_trace.features.astype(np.float64),
        num_accepted=sample_trace.num_accepted.astype(np.uint8),
        step=sample_trace.step.astype(np.int32),
    )
    checked = loose.validate()
    assert checked.features.dtype == np.float32
    assert checked.num_accepted.dtype == np.int32
    assert checked.step.dtype == np.int64


# --- validation errors on corrupted copies ----------------------------------------


def base_arrays() -> dict[str, np.ndarray]:
    trace = read_trace(bundled_sample_path()).slice_steps(0, 20)
    return {name: np.array(value) for name, value in trace.arrays().items()}


def apply(arrays: dict[str, np.ndarray], op: tuple) -> None:
    """One corruption: ("drop", key) | ("set", key, index, value) | ("cast", key, dtype)
    | ("take", key, index) | ("raw", key, array) | ("meta", {key: value or DROP})."""
    kind, key, *args = op
    if kind == "drop":
        del arrays[key]
    elif kind == "set":
        arrays[key][args[0]] = args[1]
    elif kind == "cast":
        arrays[key] = arrays[key].astype(args[0])
    elif kind == "take":
        arrays[key] = arrays[key][args[0]]
    elif kind == "raw":
        arrays[key] = args[0]
    else:
        meta = json.loads(str(arrays["meta"]))
        meta.update(key)
        meta = {name: value for name, value in meta.items() if value is not DROP}
        arrays["meta"] = np.array(json.dumps(meta))


DROP = object()
NOT_JSON, LIST_JSON = np.array("{not json"), np.array("[1, 2]")

# (case, corruption(s), array the error must name, text its problem must contain)
CASES = [
    ("missing features", [("drop", "features")], "features", "missing"),
    ("missing step", [("drop", "step")], "step", "missing"),
    ("missing meta", [("drop", "meta")], "meta", "missing"),
    ("features int", [("cast", "features", np.int32)], "features", "dtype"),
    ("features 1-D", [("take", "features", (slice(None), 0))], "features", "2-D"),
    ("features K", [("take", "features", (slice(None), slice(0, 4)))], "features", "K=4"),
    ("features NaN", [("set", "features", (3, 2), np.nan)], "features", "NaN"),
    ("features range", [("set", "features", (0, 0), 40.5)], "features", "[-40, 40]"),
    ("verified float", [("cast", "num_verified", np.float32)], "num_verified", "integer"),
    ("verified shape", [("take", "num_verified", slice(0, -1))], "num_verified", "shape"),
    ("verified > K", [("set", "num_verified", 0, 6)], "num_verified", "[0, K=5]"),
    ("verified < 0", [("set", "num_verified", 0, -1)], "num_verified", "[0, K=5]"),
    (
        "accepted > verified",
        [("set", "num_verified", 5, 2), ("set", "num_accepted", 5, 3)],
        "num_accepted",
        "exceeds num_verified at row 5",
    ),
    ("accepted < 0", [("set", "num_accepted", 1, -1)], "num_accepted", ">= 0"),
    ("step decreasing", [("set", "step", -1, 0)], "step", "non-decreasing"),
    ("step 2-D", [("take", "step", (slice(None), None))], "step", "shape"),
    ("request float", [("cast", "request", float)], "request", "integer"),
    ("request twice", [("set", "request", 1, 0), ("set", "request", 0, 0)], "request", "twice"),
    ("meta not JSON", [("raw", "meta", NOT_JSON)], "meta", "JSON"),
    ("meta not object", [("raw", "meta", LIST_JSON)], "meta", "object"),
    ("meta not string", [("raw", "meta", np.array(5))], "meta", "string"),
    ("meta 1-D", [("raw", "meta", np.array(["{}"]))], "meta", "0-d"),
    ("meta format", [("meta", {"format": "avest-trace/2"})], "meta", "avest-trace/1"),
    ("meta no K", [("meta", {"num_speculative_tokens": DROP})], "meta", "num_speculative_tokens"),
    ("meta K type", [("meta", {"num_speculative_tokens": "5"})], "meta", "num_speculative_tokens"),
    ("meta no target", [("meta", {"target": DROP})], "meta", "target"),
    ("meta temperature", [("meta", {"temperature": None})], "meta", "temperature"),
    ("meta K mismatch", [("meta", {"num_speculative_tokens": 6})], "features", "K=5"),
    (
        "optional shape",
        [("take", "logit_q_sampled", (slice(None), slice(0, 2)))],
        "logit_q_sampled",
        "shape",
    ),
    ("optional range", [("set", "accept_rate_dist", (0, 0), 1.5)], "accept_rate_dist", "[0, 1]"),
    ("optional NaN", [("set", "accept_prob_token", (0, 1), np.nan)], "accept_prob_token", "NaN"),
    ("optional int", [("cast", "accept_prob_token", np.int8)], "accept_prob_token", "dtype"),
    ("pickled array", [("cast", "features", object)], "features", "pickle"),
]


@pytest.mark.parametrize(("case", "ops", "array", "text"), CASES, ids=[c[0] for c in CASES])
def test_read_refuses_corrupted_copy(tmp_path, case, ops, array, text):
    arrays = base_arrays()
    for op in ops:
        apply(arrays, op)
    path = tmp_path / "bad.npz"
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # plain numpy, so allow_pickle is numpy's default (True)
    with pytest.raises(TraceError) as info:
        read_trace(path)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.array == array
    assert text in err.problem
    assert f"'{array}'" in str(err) and str(path) in str(err)


def test_read_refuses_files_that_are_not_archives(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(TraceError) as info:
        read_trace(garbage)
    assert info.value.array == "file"
    single = tmp_path / "single.npy"
    np.save(single, np.zeros(3))
    with pytest.raises(TraceError) as info:
        read_trace(single)
    assert info.value.array == "file"
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "absent.npz")


def test_unknown_arrays_are_ignored(tmp_path):
    arrays = base_arrays()
    arrays["future_extension"] = np.zeros(3)
    path = tmp_path / "ext.npz"
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    assert read_trace(path).rows == arrays["features"].shape[0]


def test_corrupted_copies_are_readable_before_corruption(tmp_path):
    """The corruption tests start from a valid archive: make sure of it."""
    path = tmp_path / "ok.npz"
    with open(path, "wb") as f:
        np.savez(f, **base_arrays())
    assert read_trace(path).num_steps == 20


# --- the synthetic generator (conftest) ---------------------------------------


def test_synthetic_trace_follows_its_model(make_synthetic_trace):
    trace = make_synthetic_trace(
        steps=500, requests=32, k=4, slope=0.6, intercepts=[1.0, 0.5, 0.0, -0.5]
    )
    assert trace.rows == 16_000 and trace.k == 4 and trace.num_steps == 500
    assert trace.meta["truth"] == {"slope": 0.6, "intercepts": [1.0, 0.5, 0.0, -0.5]}
    p = sigmoid(0.6 * trace.features.astype(np.float64) + np.array([1.0, 0.5, 0.0, -0.5]))
    np.testing.assert_allclose(trace.accept_rate_dist, p, rtol=1e-6)
    obs, acc = trace.labels()
    for i in range(4):
        m = obs[:, i]
        # Given it is observed, a draft is accepted with its own probability.
        mean, n = p[m, i].mean(), m.sum()
        se = np.sqrt(mean * (1 - mean) / n)
        assert abs(acc[m, i].mean() - mean) < 4 * se
    x = trace.features
    assert abs(float(x.mean())) < 0.2 and 1.7 < float(x.std()) < 2.4


def test_synthetic_trace_options(make_synthetic_trace, tmp_path):
    a = make_synthetic_trace(steps=20, requests=4, k=3, seed=1)
    b = make_synthetic_trace(steps=20, requests=4, k=3, seed=1)
    np.testing.assert_array_equal(a.features, b.features)
    trimmed = make_synthetic_trace(steps=50, requests=4, k=6, intercepts=3.0, num_verified=2)
    assert (trimmed.num_verified == 2).all() and trimmed.num_accepted.max() == 2
    assert trimmed.labelled_count() <= 2 * trimmed.rows
    churn = make_synthetic_trace(steps=10, requests=4, steps_per_request=5)
    assert len(set(churn.request.tolist())) == 8
    assert_same(read_trace(write_trace(tmp_path / "s.npz", churn)), churn)
