"""avest's wire contract, shared by the client and the service.

- :mod:`avest_wire.v1`: the messages and the ``EstimatorService`` stub, generated from
  ``protos/avest/v1/estimator.proto`` by ``scripts/gen-protos`` (proto package ``avest.v1``);
- :mod:`avest_wire.matrix`: how feature and confidence matrices travel (float32
  little-endian, row-major, with a shape).

Nothing here imports the service or the client.
"""
