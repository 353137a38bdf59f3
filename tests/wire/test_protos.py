"""The wire contract: protos/avest/v1/estimator.proto and its generated Python code.

Checks that the committed modules import under the installed protobuf (7.x) and
under vLLM's floor (protobuf 6.33.5, in a throwaway venv), that every message
survives a serialize/parse round trip, that float32 arrays travel as little-endian
bytes, that the service shape is the documented one, and (when the toolchain can be
installed) that the generated code is up to date and buf lint is clean.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.timestamp_pb2 import Timestamp

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
GENERATED_DIR = ROOT / "wire" / "avest_wire" / "v1"
GENERATED = ("estimator_pb2.py", "estimator_pb2.pyi", "estimator_pb2_grpc.py")

# vLLM 0.33 requires protobuf >= 6.33.5: the generated code must import there.
PROTOBUF_FLOOR = (6, 33, 5)
# The oldest grpcio the project allows (pyproject: grpcio>=1.81).
GRPCIO_FLOOR = "1.81.0"

FIELD = _descriptor.FieldDescriptor


# ---------------------------------------------------------------------------
# Declared runtime floors


def _declared_protobuf_minimum() -> tuple[int, int, int]:
    """(major, minor, patch) passed to ValidateProtobufRuntimeVersion in estimator_pb2.py."""
    tree = ast.parse((GENERATED_DIR / "estimator_pb2.py").read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "ValidateProtobufRuntimeVersion"
        ):
            major, minor, patch = (ast.literal_eval(a) for a in node.args[1:4])
            return major, minor, patch
    raise AssertionError("estimator_pb2.py does not call ValidateProtobufRuntimeVersion")


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def test_declared_protobuf_minimum_allows_6_33():
    declared = _declared_protobuf_minimum()
    assert declared[:2] <= (6, 33), f"generated code demands protobuf {declared}; must be <= 6.33"
    assert declared <= PROTOBUF_FLOOR, f"generated code demands protobuf {declared} > 6.33.5"
    header = (GENERATED_DIR / "estimator_pb2.py").read_text().splitlines()[:8]
    assert "# Protobuf Python Version: {}.{}.{}".format(*declared) in header


def test_declared_grpcio_minimum_matches_project_floor():
    assert _version_tuple(pb_grpc.GRPC_GENERATED_VERSION) <= _version_tuple(GRPCIO_FLOOR)
    assert pb_grpc.GRPC_GENERATED_VERSION.startswith("1.81."), pb_grpc.GRPC_GENERATED_VERSION


def test_project_dependency_floors_cover_generated_code():
    """pyproject's floors must not allow a runtime the generated code refuses."""
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {}
    for dep in deps:
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*([^;]*)", dep)
        assert m
        lo = re.search(r">=\s*([0-9][0-9.]*)", m.group(2))
        if lo:
            floors[m.group(1).lower()] = lo.group(1)
    assert _version_tuple(floors["protobuf"]) >= _declared_protobuf_minimum()
    assert _version_tuple(floors["grpcio"]) + (0,) * 3 >= _version_tuple(
        pb_grpc.GRPC_GENERATED_VERSION
    )


def test_imports_under_installed_protobuf():
    import google.protobuf

    installed = _version_tuple(google.protobuf.__version__)
    assert installed >= _declared_protobuf_minimum()
    assert pb.DESCRIPTOR.package == "avest.v1"
    assert pb.DESCRIPTOR.name == "avest/v1/estimator.proto"
    assert [d.name for d in pb.DESCRIPTOR.dependencies] == ["google/protobuf/timestamp.proto"]


# ---------------------------------------------------------------------------
# Service shape

EXPECTED_RPCS = {
    # name: (client streaming, server streaming)
    "RegisterPair": (False, False),
    "Observe": (True, True),
    "GetCoefficients": (False, False),
    "WatchCoefficients": (False, True),
    "Score": (False, False),
    "Budget": (False, False),
    "SetCostCurves": (False, False),
    "ListPairs": (False, False),
    "GetPair": (False, False),
    "DeletePair": (False, False),
    "GetSchedule": (False, False),
}


def test_service_shape():
    service = pb.DESCRIPTOR.services_by_name["EstimatorService"]
    assert service.full_name == "avest.v1.EstimatorService"
    assert {m.name for m in service.methods} == set(EXPECTED_RPCS)
    for method in service.methods:
        assert (method.client_streaming, method.server_streaming) == EXPECTED_RPCS[method.name]
        assert method.input_type.full_name == f"avest.v1.{method.name}Request"
        assert method.output_type.full_name == f"avest.v1.{method.name}Response"
    for name in ("EstimatorServiceStub", "EstimatorServiceServicer"):
        assert hasattr(pb_grpc, name)
    assert callable(pb_grpc.add_EstimatorServiceServicer_to_server)


def test_enums():
    # Each enum's values in order, UNSPECIFIED (0) first.
    enums = (
        (pb.UpdateRule, "UPDATE_RULE_", "UNSPECIFIED VLLM RECURSIVE TRACKING"),
        (pb.BudgetRule, "BUDGET_RULE_", "UNSPECIFIED STALE LOSSLESS_WALK ARGMAX FULL"),
    )
    for enum, prefix, values in enums:
        assert list(enum.keys()) == [prefix + v for v in values.split()]
        assert enum.Name(0) == prefix + "UNSPECIFIED"


def test_observe_response_oneof():
    resp = pb.ObserveResponse(ack=pb.Ack(pair_id="p", worker_id="w", acked_sequence=7))
    assert resp.WhichOneof("event") == "ack"
    resp.coefficients_update.coefficients.version = 3
    assert resp.WhichOneof("event") == "coefficients_update"
    assert not resp.HasField("ack")
    again = pb.ObserveResponse.FromString(resp.SerializeToString())
    assert again.WhichOneof("event") == "coefficients_update"
    assert again.coefficients_update.coefficients.version == 3


# ---------------------------------------------------------------------------
# Round trip of every message


def _sample_scalar(field: _descriptor.FieldDescriptor, i: int):
    t = field.type
    if t == FIELD.TYPE_STRING:
        return f"{field.name}-{i}-é"
    if t == FIELD.TYPE_BYTES:
        return np.arange(4 + i, dtype="<f4").tobytes()
    if t == FIELD.TYPE_BOOL:
        return i % 2 == 0
    if t == FIELD.TYPE_ENUM:
        values = field.enum_type.values
        return values[min(1 + i, len(values) - 1)].number
    if t in (FIELD.TYPE_DOUBLE, FIELD.TYPE_FLOAT):
        return 0.25 + i  # exactly representable in float32 and float64
    if t in (FIELD.TYPE_UINT64, FIELD.TYPE_FIXED64):
        return 2**40 + i
    if t in (FIELD.TYPE_UINT32, FIELD.TYPE_FIXED32):
        return 2**31 + i
    if t in (FIELD.TYPE_INT64, FIELD.TYPE_SINT64, FIELD.TYPE_SFIXED64):
        return -(2**40) - i
    if t in (FIELD.TYPE_INT32, FIELD.TYPE_SINT32, FIELD.TYPE_SFIXED32):
        return -(2**30) - i
    raise AssertionError(f"unhandled field type {t} for {field.full_name}")


def _fill(msg: _message.Message, depth: int = 0) -> _message.Message:
    """Set every field of msg (recursively, one oneof member) to a non-default value."""
    seen_oneofs = set()
    for field in msg.DESCRIPTOR.fields:
        if field.containing_oneof is not None:
            if field.containing_oneof.name in seen_oneofs:
                continue
            seen_oneofs.add(field.containing_oneof.name)
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if is_map:
            container = getattr(msg, field.name)
            for i in range(3):
                container[f"k{i}"] = f"v{i}"
        elif field.type == FIELD.TYPE_MESSAGE:
            if field.message_type.full_name == "google.protobuf.Timestamp":
                ts = Timestamp(seconds=1_795_000_000, nanos=123_456_789)
                if field.is_repeated:
                    getattr(msg, field.name).append(ts)
                else:
                    getattr(msg, field.name).CopyFrom(ts)
            elif field.is_repeated:
                for _ in range(2):
                    _fill(getattr(msg, field.name).add(), depth + 1)
            else:
                _fill(getattr(msg, field.name), depth + 1)
        elif field.is_repeated:
            getattr(msg, field.name).extend(_sample_scalar(field, i) for i in range(3))
        else:
            setattr(msg, field.name, _sample_scalar(field, depth))
    return msg


ALL_MESSAGES = sorted(pb.DESCRIPTOR.message_types_by_name)


@pytest.mark.parametrize("name", ALL_MESSAGES)
def test_round_trip_every_message(name):
    cls = getattr(pb, name)
    msg = _fill(cls())
    data = msg.SerializeToString()
    again = cls.FromString(data)
    assert again == msg
    assert again.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)
    # Every (non-oneof-alternative) field survived with a non-default value.
    for field in cls.DESCRIPTOR.fields:
        if field.containing_oneof is not None:
            continue
        if field.is_repeated:
            assert len(getattr(again, field.name)) > 0, field.name
        elif field.type == FIELD.TYPE_MESSAGE:
            assert again.HasField(field.name), field.name
        else:
            assert getattr(again, field.name) != field.default_value, field.name
    # An empty message round-trips to an empty message.
    assert cls.FromString(cls().SerializeToString()) == cls()


def test_every_message_and_field_is_covered():
    """No message or enum in the file escapes the round-trip test."""
    assert set(ALL_MESSAGES) == {
        "PairKey",
        "Coefficients",
        "RegisterPairRequest",
        "RegisterPairResponse",
        "ObserveRequest",
        "Ack",
        "CoefficientsUpdate",
        "ObserveResponse",
        "WorkerOpened",
        "GetCoefficientsRequest",
        "GetCoefficientsResponse",
        "WatchCoefficientsRequest",
        "WatchCoefficientsResponse",
        "ScoreRequest",
        "ScoreResponse",
        "BudgetRequest",
        "BudgetResponse",
        "CostPoint",
        "SetCostCurvesRequest",
        "SetCostCurvesResponse",
        "ListPairsRequest",
        "ListPairsResponse",
        "GetPairRequest",
        "GetScheduleRequest",
        "GetScheduleResponse",
        "ScheduleRange",
        "GetPairResponse",
        "Pair",
        "Calibration",
        "PositionCalibration",
        "DeletePairRequest",
        "DeletePairResponse",
        "RoundSummary",
        "CalibrationSketch",
        "ReachedCounts",
        "StratumCoefficients",
    }
    assert set(pb.DESCRIPTOR.enum_types_by_name) == {"UpdateRule", "BudgetRule"}


def test_coefficients_version_has_presence():
    req = pb.ObserveRequest()
    assert not req.HasField("coefficients_version")
    req.coefficients_version = 0  # version 0 (cold start) differs from "unknown"
    got = pb.ObserveRequest.FromString(req.SerializeToString())
    assert got.HasField("coefficients_version")
    assert got.coefficients_version == 0


def test_repeated_counts_are_packed():
    """num_verified (field 7) is one length-delimited record, not one tag per entry."""
    msg = pb.ObserveRequest(num_verified=[1, 2, 3])
    assert msg.SerializeToString() == bytes([(7 << 3) | 2, 3, 1, 2, 3])
    msg = pb.ObserveRequest(exclude=[True, False])
    assert msg.SerializeToString() == bytes([(9 << 3) | 2, 2, 1, 0])


def test_nan_calibration_survives():
    cal = pb.Calibration(auc=float("nan"), count=0)
    again = pb.Calibration.FromString(cal.SerializeToString())
    assert np.isnan(again.auc)


# ---------------------------------------------------------------------------
# Float32 little-endian arrays


def to_f32le(a) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def from_f32le(b: bytes, rows: int, k: int) -> np.ndarray:
    assert len(b) == rows * k * 4
    return np.frombuffer(b, dtype="<f4").reshape(rows, k)


def test_features_round_trip():
    rng = np.random.default_rng(0)
    rows, k = 64, 8
    x = rng.uniform(-40, 40, size=(rows, k)).astype(np.float32)
    x[0, :4] = [-40.0, 40.0, 0.0, np.float32(1e-30)]
    verified = rng.integers(0, k + 1, size=rows)
    accepted = np.minimum(verified, rng.integers(0, k + 1, size=rows))
    req = pb.ObserveRequest(
        pair_id="pair-1",
        worker_id="host:123:abc",
        sequence=1,
        features=to_f32le(x),
        rows=rows,
        k=k,
        num_verified=verified.tolist(),
        num_accepted=accepted.tolist(),
        exclude=[False] * rows,
        coefficients_version=1,
    )
    assert len(req.features) == rows * k * 4
    got = pb.ObserveRequest.FromString(req.SerializeToString())
    back = from_f32le(got.features, got.rows, got.k)
    assert back.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(back, x)
    np.testing.assert_array_equal(np.asarray(got.num_verified), verified)
    np.testing.assert_array_equal(np.asarray(got.num_accepted), accepted)


def test_features_byte_order_is_little_endian():
    big = np.array([[1.0, -2.0]], dtype=">f4")  # big-endian input is converted, not copied
    b = to_f32le(big)
    assert b == bytes.fromhex("0000803f") + bytes.fromhex("000000c0")
    np.testing.assert_array_equal(from_f32le(b, 1, 2), [[1.0, -2.0]])
    # float64 input is narrowed to float32.
    assert to_f32le(np.array([[0.5]], dtype=np.float64)) == bytes.fromhex("0000003f")


def test_score_and_budget_arrays_round_trip():
    rng = np.random.default_rng(1)
    rows, k = 256, 16
    conf = rng.uniform(0, 1, size=(rows, k)).astype(np.float32)
    surv = np.cumprod(conf, axis=1, dtype=np.float32)
    resp = pb.ScoreResponse(
        confidences=to_f32le(conf), survival=to_f32le(surv), coefficients_version=4
    )
    got = pb.ScoreResponse.FromString(resp.SerializeToString())
    np.testing.assert_array_equal(from_f32le(got.confidences, rows, k), conf)
    np.testing.assert_array_equal(from_f32le(got.survival, rows, k), surv)
    req = pb.BudgetRequest(
        pair_id="p",
        confidences=to_f32le(conf),
        stale_confidences=to_f32le(conf[::-1]),
        rows=rows,
        k=k,
        scheduled_drafts=[k] * rows,
        num_non_draft_tokens=rows,
        num_sampling_requests=rows,
        hardware="H200",
        rule=pb.BUDGET_RULE_LOSSLESS_WALK,
        min_drafts_per_request=1,
    )
    got_req = pb.BudgetRequest.FromString(req.SerializeToString())
    np.testing.assert_array_equal(from_f32le(got_req.stale_confidences, rows, k), conf[::-1])
    assert got_req.rule == pb.BUDGET_RULE_LOSSLESS_WALK


# ---------------------------------------------------------------------------
# The generated stubs over a real channel (a toy servicer, not the avest server)


class _ToyServicer(pb_grpc.EstimatorServiceServicer):
    def Score(self, request, context):
        x = from_f32le(request.features, request.rows, request.k)
        p = (1.0 / (1.0 + np.exp(-(0.5 * x - 0.2)))).astype(np.float32)
        return pb.ScoreResponse(
            confidences=to_f32le(p),
            survival=to_f32le(np.cumprod(p, axis=1)),
            coefficients_version=1,
        )

    def Observe(self, request_iterator, context):
        for req in request_iterator:
            yield pb.ObserveResponse(
                ack=pb.Ack(
                    pair_id=req.pair_id, worker_id=req.worker_id, acked_sequence=req.sequence
                )
            )

    def WatchCoefficients(self, request, context):
        for v in (1, 2):
            yield pb.WatchCoefficientsResponse(
                coefficients=pb.Coefficients(pair_id=request.pair_id, version=v, slope=0.5)
            )


def test_stubs_over_a_real_channel():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_EstimatorServiceServicer_to_server(_ToyServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.EstimatorServiceStub(channel)
            x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
            resp = stub.Score(
                pb.ScoreRequest(pair_id="p", features=to_f32le(x), rows=3, k=4), timeout=10
            )
            p = from_f32le(resp.confidences, 3, 4)
            np.testing.assert_allclose(p, 1 / (1 + np.exp(-(0.5 * x - 0.2))), rtol=1e-6)
            steps = (pb.ObserveRequest(pair_id="p", worker_id="w", sequence=s) for s in (1, 2, 5))
            acks = [r.ack.acked_sequence for r in stub.Observe(steps, timeout=10)]
            assert acks == [1, 2, 5]
            versions = [
                r.coefficients.version
                for r in stub.WatchCoefficients(
                    pb.WatchCoefficientsRequest(pair_id="p"), timeout=10
                )
            ]
            assert versions == [1, 2]
            with pytest.raises(grpc.RpcError) as err:
                stub.Budget(pb.BudgetRequest(pair_id="p"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(grace=None)


# ---------------------------------------------------------------------------
# Import under protobuf 6.33.5 (vLLM 0.33's floor) and grpcio 1.81.0, in a cached venv

OLD_PINS = ("protobuf==6.33.5", "grpcio==1.81.0")

_OLD_RUNTIME_SCRIPT = r"""
import json, sys
import google.protobuf, grpc
from avest_wire.v1 import estimator_pb2 as pb, estimator_pb2_grpc as pb_grpc
data = json.loads(sys.stdin.read())
out = {"protobuf": google.protobuf.__version__, "grpcio": grpc.__version__, "messages": {}}
for name, hexdata in data.items():
    msg = getattr(pb, name).FromString(bytes.fromhex(hexdata))
    out["messages"][name] = msg.SerializeToString(deterministic=True).hex()
assert "EstimatorServiceStub" in dir(pb_grpc)
print(json.dumps(out))
"""


def _old_runtime_venv() -> Path:
    """A venv with OLD_PINS, cached under the temp dir across test sessions."""
    key = hashlib.sha256(repr((sys.version, sys.executable, OLD_PINS)).encode()).hexdigest()[:12]
    venv = Path(tempfile.gettempdir()) / f"avest-test-protobuf-6.33-{key}"
    py = venv / "bin" / "python"
    if (venv / ".complete").exists() and py.exists():
        return py
    staging = Path(tempfile.mkdtemp(prefix=venv.name + ".", dir=venv.parent))
    try:
        r = subprocess.run(
            [sys.executable, "-m", "venv", str(staging)], capture_output=True, text=True
        )
        if r.returncode != 0:
            pytest.skip(f"cannot create a venv for the protobuf 6.33 check: {r.stderr[-500:]}")
        r = subprocess.run(
            [
                str(staging / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                *OLD_PINS,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            pytest.skip(
                f"{' '.join(OLD_PINS)} not installable (package index unreachable?): "
                f"{(r.stderr or r.stdout)[-800:]}"
            )
        (staging / ".complete").touch()
        try:
            staging.rename(venv)
        except OSError:
            # Another session won the race (or a stale partial copy exists); use it if complete.
            if not (venv / ".complete").exists():
                shutil.rmtree(venv, ignore_errors=True)
                staging.rename(venv)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    # venv scripts hard-code the venv path; the interpreter itself relocates fine
    # (pyvenv.cfg names the base interpreter).
    return py


def test_imports_and_interoperates_on_protobuf_6_33(tmp_path):
    py = _old_runtime_venv()
    # Import only the generated modules: a bare `avest_wire` package, so the check
    # does not depend on what the rest of the wire package imports.
    pkg = tmp_path / "avest_wire" / "v1"
    pkg.mkdir(parents=True)
    (tmp_path / "avest_wire" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    for name in ("estimator_pb2.py", "estimator_pb2_grpc.py"):
        shutil.copy(GENERATED_DIR / name, pkg / name)
    messages = {name: _fill(getattr(pb, name)()) for name in ALL_MESSAGES}
    payload = json.dumps({n: m.SerializeToString().hex() for n, m in messages.items()})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    r = subprocess.run(
        [
            str(py),
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + _OLD_RUNTIME_SCRIPT,
        ],
        input=payload,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["protobuf"] == "6.33.5"
    assert out["grpcio"] == "1.81.0"
    for name, hexdata in out["messages"].items():
        assert getattr(pb, name).FromString(bytes.fromhex(hexdata)) == messages[name], name


# ---------------------------------------------------------------------------
# Toolchain checks (skipped only when the toolchain cannot be installed)


def _run_gen_protos(*args: str) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [str(ROOT / "scripts" / "gen-protos"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=900,
    )
    if r.returncode == 3:
        pytest.skip(f"gen-protos toolchain unavailable: {r.stderr.strip()[-800:]}")
    return r


def test_generated_code_is_up_to_date():
    r = _run_gen_protos("--check")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm (Node.js) is not installed")
def test_buf_lint_clean():
    r = _run_gen_protos("--lint")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("npm") is None, reason="npm (Node.js) is not installed")
def test_the_contract_only_grew_since_0_1_0():
    """buf breaking against the first release's protos (commit 1cba659)."""
    r = _run_gen_protos("--breaking")
    assert r.returncode == 0, r.stdout + r.stderr
