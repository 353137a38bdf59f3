"""Prometheus export. Placeholder until the full metrics module lands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class Metrics:
    def __init__(self, app: Any, registry: CollectorRegistry | None = None) -> None:
        self.app = app
        self.registry = registry or CollectorRegistry()
        self._open_streams: Callable[[], int] = lambda: 0

    def set_open_streams(self, fn: Callable[[], int]) -> None:
        self._open_streams = fn

    def refused(self, method: str, reason: str) -> None:
        pass

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        class _Pass(grpc.aio.ServerInterceptor):
            async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
                return await continuation(handler_call_details)

        return _Pass()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
