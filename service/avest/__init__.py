"""avest: the acceptance-estimator sidecar for speculative decoding."""

__version__ = "0.2.0.dev0"
