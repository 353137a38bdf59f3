"""avest: the acceptance-estimator sidecar for speculative decoding."""

__version__ = "0.1.0"
