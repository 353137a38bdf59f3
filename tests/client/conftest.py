"""Fixtures of the client tests (the servers they run against are the shared ones of
:mod:`tests.support.fixtures`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support.traces import Step, trace_steps


@pytest.fixture
def chat_steps(trace_slice: Callable[..., Any]) -> Callable[[int, int], tuple[int, list[Step]]]:
    """``(K, steps)`` of decode steps ``[start, stop)`` of the shared chat trace."""

    def get(start: int = 0, stop: int = 200) -> tuple[int, list[Step]]:
        trace = trace_slice("chat", start, stop)
        return trace.k, trace_steps(trace)

    return get
