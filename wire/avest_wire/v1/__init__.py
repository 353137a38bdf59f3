"""The wire contract, version 1: modules generated from protos/avest/v1/ by scripts/gen-protos.

``estimator_pb2`` holds the messages and enums, ``estimator_pb2_grpc`` the
``EstimatorService`` stub, servicer base and registration helper. Do not edit the
generated modules; change the .proto and rerun ``scripts/gen-protos``.
"""
