"""The shared fixtures of every test folder: :mod:`tests.support.fixtures` (traces,
in-process servers, a subprocess service) and :mod:`tests.support.postgres` (a real
PostgreSQL server). Shared helpers are in :mod:`tests.support`."""

pytest_plugins = ["tests.support.fixtures", "tests.support.postgres"]
