"""The gRPC adapter: ``avest.v1.EstimatorService`` over the state.

- :mod:`.service`: the servicer (one method per RPC);
- :mod:`.observe`: one ``Observe`` stream (apply, acknowledge when durable, push updates);
- :mod:`.convert`: state to messages; :mod:`.refusals`: errors to status codes;
- :mod:`.interceptor`: call timing by method and code.
"""
