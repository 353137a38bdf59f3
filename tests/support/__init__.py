"""What the tests share: traces, servers and the helpers around them.

- :mod:`tests.support.fixtures`: the pytest fixtures over all of these (a plugin that
  ``tests/conftest.py`` loads, so every folder sees them).
- :mod:`tests.support.server`: an in-process server on ``127.0.0.1:0`` on a thread of
  its own (:func:`~tests.support.server.launch`).
- :mod:`tests.support.serve`: ``avest serve`` as a subprocess, its ports read back from
  its announcement line (:func:`~tests.support.serve.serve`); the benchmarks start
  their services with it too.
- :mod:`tests.support.live`: an in-process server with a gRPC stub and an HTTP client,
  pair registration and Observe streams over it.
- :mod:`tests.support.rpc`: the gRPC API over a raw stub (pairs, Observe messages and
  streams).
- :mod:`tests.support.metrics`, :mod:`tests.support.http`, :mod:`tests.support.calibration`:
  what the metrics, admin HTTP and calibration-layer tests share.
- :mod:`tests.support.traces` and :mod:`tests.support.steps`: named and synthetic
  traces, decode steps with a known truth, in-process replays.
- :mod:`tests.support.standin`: a CPU stand-in for vLLM 0.33's ``OnlineAcceptanceEstimator``;
  :mod:`tests.support.tracedrive`: decode steps that drive it from a trace, and the core
  estimator fed the same rows; :mod:`tests.support.sidecar`: the shim over a real
  sidecar sink.
- :mod:`tests.support.docker`: Dockerfiles and Compose as the tests read them.
- :mod:`tests.support.helpers`: free ports, polling, loopback HTTP, tools on PATH,
  float32 rounding, a missing vLLM environment.

Test modules import shared code from here only, never from one another
(``tests/test_layout.py`` checks it).
"""
