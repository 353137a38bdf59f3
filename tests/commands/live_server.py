"""A real server for the command tests: ``tests/service/conftest.py``'s ``launch`` and its
``server`` fixture.

That conftest is not visible from this folder, so it is loaded by path (as
``tests/client/conftest.py`` does).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SERVICE_CONFTEST = Path(__file__).resolve().parent.parent / "service" / "conftest.py"
_NAME = "avest_tests_service_conftest"
if _NAME in sys.modules:
    service_conftest = sys.modules[_NAME]
else:
    _spec = importlib.util.spec_from_file_location(_NAME, _SERVICE_CONFTEST)
    assert _spec is not None and _spec.loader is not None
    service_conftest = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = service_conftest
    _spec.loader.exec_module(service_conftest)

launch = service_conftest.launch
ServerHandle = service_conftest.ServerHandle
server = service_conftest.server  # the fixture: a real server on a fresh data dir, stopped after
