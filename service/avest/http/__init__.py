"""The admin HTTP adapter and the Prometheus metrics, over the state.

- :mod:`.api`: the FastAPI application (health, pairs, reliability diagrams, /metrics);
- :mod:`.models`: its response models;
- :mod:`.metrics`, :mod:`.collector`, :mod:`.names`: the metrics, the per-pair
  collector read at scrape time, and every metric's name and help.
"""
