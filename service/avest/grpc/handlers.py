"""A gRPC method handler rebuilt around another behaviour, of the same kind.

The kind (one request or a stream of them, one response or a stream) fixes both
the factory that builds the handler and the shape of its behaviour, so every
wrapper (the timing interceptor, the gate, its refusals) keeps the kind it finds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

#: The four kinds of method handler, named as the handler's behaviour attributes.
FACTORIES: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def rebuilt(
    handler: grpc.RpcMethodHandler,
    wraps: Mapping[str, Wrap],
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    """``handler``'s kind again, its behaviour passed through ``wraps[kind]``, reading
    requests with ``request_deserializer``; ``handler`` itself when ``wraps`` leaves
    its kind out."""
    for kind, wrap in wraps.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return FACTORIES[kind](
                wrap(behavior),
                request_deserializer=request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler
