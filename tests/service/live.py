"""A live server for the admin HTTP and metrics tests: the conftest ``start_server``
handle plus a gRPC stub and an HTTP client, and pair registration."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from avest_wire.v1 import estimator_pb2 as pb
from avest_wire.v1 import estimator_pb2_grpc as pb_grpc

TOKEN = "s3cret"

# -- the live server (tests/service/conftest.py's ``start_server``) plus clients --


class Live:
    """A started server (conftest ``ServerHandle``) with a gRPC stub and an HTTP client."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.grpc_address = handle.grpc_address
        self.http_url = handle.http_url
        self.channel = grpc.insecure_channel(self.grpc_address)
        self.stub = pb_grpc.EstimatorServiceStub(self.channel)
        self.http = httpx.Client(base_url=self.http_url, timeout=10)

    def close(self) -> None:
        self.http.close()
        self.channel.close()

    def stop(self) -> None:
        self.close()
        self.handle.stop()


@pytest.fixture
def open_server(start_server: Callable[..., Any], tmp_path: Path) -> Iterator[Callable[..., Live]]:
    """``open_server(**settings)``: a live server on free ports, on one data directory
    (so a second call after ``stop()`` restarts on the same state)."""
    opened: list[Live] = []

    def open_(**overrides: Any) -> Live:
        values: dict[str, Any] = {
            "refit_interval": 10,
            "flush_interval_ms": 10,
            "admin_token": TOKEN,
            "grace_s": 2.0,
        }
        values.update(overrides)
        live = Live(start_server(tmp_path / "data", **values))
        opened.append(live)
        return live

    yield open_
    for live in opened:
        live.close()


@pytest.fixture
def live(open_server: Callable[..., Live]) -> Live:
    return open_server()


def register(
    live: Live,
    k: int = 5,
    refit_interval: int = 10,
    *,
    target: str = "target-model",
    rule: int = pb.UPDATE_RULE_RECURSIVE,
    **labels: str,
) -> str:
    resp = live.stub.RegisterPair(
        pb.RegisterPairRequest(
            key=pb.PairKey(
                target_model=target,
                draft_model="draft-model",
                method="eagle",
                num_speculative_tokens=k,
                labels=labels,
            ),
            update_rule=rule,
            refit_interval=refit_interval,
        ),
        timeout=10,
    )
    return str(resp.pair_id)
