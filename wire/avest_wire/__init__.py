"""avest's wire contract in Python, shared by the client, the shim and the service.

- :mod:`avest_wire.v1`: the messages and the ``EstimatorService`` stub, generated from
  ``protos/avest/v1/estimator.proto`` by ``scripts/gen-protos`` (proto package ``avest.v1``);
- :mod:`avest_wire.matrix`: how feature and confidence matrices travel (float32
  little-endian, row-major, with a shape);
- :mod:`avest_wire.limits`: every size limit, ``MAX_K`` and the feature clamp;
- :mod:`avest_wire.bins`: the calibration sketch's bins and the calibration table's size;
- :mod:`avest_wire.coefficients`: the coefficients (one type for client, shim and
  service), their one check and the cold-start constants;
- :mod:`avest_wire.summary`: the round summary and its sketch, and their one check;
  :mod:`avest_wire.messages`: both to and from their messages;
- :mod:`avest_wire.pair`: the pair key and its stable id;
- :mod:`avest_wire.rules`: the update and budget rule names and their enum values;
- :mod:`avest_wire.strata`: a request's stratum and the bound on strata per pair;
- :mod:`avest_wire.refusal`: the refused step's sequence number in trailing metadata;
- :mod:`avest_wire.errors`: the error for input outside the contract.

``limits``, ``bins``, ``coefficients``, ``summary``, ``strata`` and ``errors`` need numpy only (the service's core
imports them); the rest need protobuf or grpc. Nothing here imports the service or the
client.
"""
