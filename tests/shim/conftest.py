"""The shim's tests run it as an operator would with cost curves on: holding the
admin token of the test servers (``SetCostCurves`` is an admin action)."""

from __future__ import annotations

import pytest

from tests.support.server import ADMIN_TOKEN


@pytest.fixture(autouse=True)
def _shim_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AVEST_TOKEN", ADMIN_TOKEN)
