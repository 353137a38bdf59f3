"""The per-pair state and its store: what the network adapters meet in.

- :mod:`.pairs`: a pair's key, its estimator and cost curves, the registry of pairs;
- :mod:`.store`: the SQLite store of pair snapshots;
- :mod:`.app`: :class:`~avest.state.app.Avest`, the registry with its persistence
  and the hooks the adapters attach to.
"""
