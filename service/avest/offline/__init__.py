"""Offline tools over recorded traces: nothing here runs inside the service.

- :mod:`.trace`: the ``avest-trace/1`` format (read, validate, write);
- :mod:`.evaluate`: replay a trace predict-then-learn and score each method;
- :mod:`.simulate`: the goodput of adaptive verification under cost curves;
- :mod:`.replay`: stream a trace into a running service as workers would;
- :mod:`.plots`: every figure (evaluation, simulation, reliability diagrams).
"""
