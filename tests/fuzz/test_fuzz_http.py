"""schemathesis over the admin HTTP API's OpenAPI, against a live server with tokens.

Every operation gets generated paths, queries and headers; every response
must conform to the schema (status code, content type, body) and none may
be a server error. Calls carry the admin token, so the reset route is
exercised too (on the two pairs registered first, or on generated ids).

Budget: ``AVEST_SCHEMATHESIS_EXAMPLES`` examples per operation (default 25).
The long run::

    AVEST_SCHEMATHESIS_EXAMPLES=1000 python -m pytest -q tests/fuzz/test_fuzz_http.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc
from tests.support.server import launch

pytestmark = pytest.mark.slow


EXAMPLES = int(os.environ.get("AVEST_SCHEMATHESIS_EXAMPLES", "25"))
WORKER_TOKEN = "fuzz-worker"
ADMIN_TOKEN = "fuzz-admin"


@pytest.fixture(scope="module")
def live_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    handle = launch(
        tmp_path_factory.mktemp("schemathesis"),
        worker_token=WORKER_TOKEN,
        admin_token=ADMIN_TOKEN,
        rpc_rate=0,
    )
    try:
        with grpc.insecure_channel(handle.grpc_address) as channel:
            stub = pb_grpc.EstimatorServiceStub(channel)
            md = (("authorization", f"Bearer {WORKER_TOKEN}"),)
            for method in ("eagle", "ngram"):
                key = pb.PairKey(
                    target_model="t", draft_model="d", method=method, num_speculative_tokens=3
                )
                stub.RegisterPair(pb.RegisterPairRequest(key=key), metadata=md, timeout=10)
        yield handle
    finally:
        handle.stop()


def _openapi() -> dict[str, Any]:
    """The served document (the routes do not run to build it)."""
    from avest.http.api import build_http
    from avest.settings import Settings

    return build_http(object(), object(), Settings()).openapi()


schema = schemathesis.openapi.from_dict(_openapi())


def test_the_schema_tested_is_the_one_served(live_http: Any) -> None:
    served = httpx.get(
        live_http.http_url + "/openapi.json",
        headers={"Authorization": f"Bearer {WORKER_TOKEN}"},
        timeout=10,
    ).json()
    assert served == _openapi()


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_admin_api_conforms_to_its_schema(case: Any, live_http: Any) -> None:
    case.call_and_validate(
        base_url=live_http.http_url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )


def test_after_schemathesis_the_service_still_serves(live_http: Any) -> None:
    r = httpx.get(live_http.http_url + "/readyz", timeout=10)
    assert r.status_code == 200
    r = httpx.get(
        live_http.http_url + "/v1/pairs",
        headers={"Authorization": f"Bearer {WORKER_TOKEN}"},
        timeout=10,
    )
    assert r.status_code == 200 and len(r.json()["pairs"]) == 2
