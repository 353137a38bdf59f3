"""The production sink: the shim's link to an avest sidecar.

- :mod:`.sink`: :class:`~avest_client.vllm.sidecar.sink.SidecarSink` (the
  :class:`~avest_client.vllm.sink.Sink` and its supervisor loop) and ``make_sink``;
- :mod:`.handoff`: the steps on their way to the client forwarder;
- :mod:`.sync`: the pair's registration, warm start and cost curves;
- :mod:`.health`: whether the sidecar's stream is up, opening, or hung;
- :mod:`.labels`: the pair's labels (hardware, sampling method);
- :mod:`.fork`: a forked child disarms the sinks it inherits.

Each part owns its state; the sink holds one of each and runs them.
"""

import logging

#: The logger of every part of the sink.
logger = logging.getLogger("avest_client.vllm.sidecar_sink")
