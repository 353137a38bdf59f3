"""The production sink: the shim's link to an avest sidecar.

- :mod:`.sink`: :class:`~avest_client.vllm.sidecar.sink.SidecarSink` and ``make_sink``;
- :mod:`.supervisor`: the background loop (connect, register with backoff, detect a hung sidecar);
- :mod:`.sync`: the pair's registration, warm start and cost curves;
- :mod:`.labels`: the pair's labels (hardware, sampling method);
- :mod:`.fork`: a forked child disarms the sinks it inherits.
"""
