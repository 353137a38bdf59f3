"""The estimator's pure math: numpy only, float64 accumulation, no I/O.

Everything else in avest (the service, the evaluation, the simulator) adapts
these functions; none of them import grpc, HTTP or storage.
"""
