"""What the tests share: traces, servers and the helpers around them.

- :mod:`tests.support.traces`: named traces (bundled, shared) and synthetic ones with
  known truth.
- :mod:`tests.support.server`: an in-process server on ``127.0.0.1:0`` on a thread of
  its own (:func:`~tests.support.server.launch`).
- :mod:`tests.support.serve`: ``avest serve`` as a subprocess, its ports read back from
  its announcement line (:func:`~tests.support.serve.serve`); the benchmarks start
  their services with it too.
- :mod:`tests.support.live`: an in-process server with a gRPC stub and an HTTP client.
- :mod:`tests.support.helpers`: free ports, polling, loopback HTTP, decode steps.
- :mod:`tests.support.fixtures`: the pytest fixtures over all of these (a plugin that
  ``tests/conftest.py`` loads, so every folder sees them).

Test modules import shared code from here only, never from one another.
"""
