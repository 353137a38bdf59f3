"""The shared fixtures of every test folder: :mod:`tests.support.fixtures` (traces,
in-process servers, a subprocess service). Shared helpers are in :mod:`tests.support`."""

pytest_plugins = ["tests.support.fixtures"]
