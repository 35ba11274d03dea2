"""Responses that carry large plans, assembled from pre-encoded bytes.

A plan of 100,000 tensors encodes to megabytes, and protobuf encodes while holding
the GIL: with grpc's own serializer every ``DescribeModel`` / ``AskHyperparameters``
would re-encode it, stalling every other thread (the health check's included) for
the whole encoding. Protobuf's wire format lets a message be built by concatenating
its fields, so a plan is encoded once (:mod:`.plancache` caches it) and each
response is the small part encoded now plus the cached plan bytes (a memcpy).

Handlers may therefore return a message or ready ``bytes``; :func:`add_to_server`
registers the service with a serializer that passes bytes through. The bytes are
exactly what the generated serializer would produce, so clients see no difference.
"""

from __future__ import annotations

from typing import Any

import grpc

from ...proto.autotune.v1 import autotune_pb2 as pb

_DESCRIPTOR = pb.DESCRIPTOR.services_by_name["AutotuneService"]
SERVICE: str = _DESCRIPTOR.full_name  # "bagua_lightning.autotune.v1.AutotuneService"

#: The service's RPC names, read from the proto descriptor: the one table both servers register.
METHODS: tuple[str, ...] = tuple(method.name for method in _DESCRIPTOR.methods)

# Field numbers in autotune.proto (never reused, so fixed here).
_REGISTER_PLAN = 1  # RegisterTensorsResponse.recommended_hyperparameters
_REGISTER_COMPLETED = 2  # RegisterTensorsResponse.is_autotune_completed
_REGISTER_SELECTION = 3  # RegisterTensorsResponse.algorithm_selection
_ASK_PLAN = 1  # AskHyperparametersResponse.recommended_hyperparameters
_ASK_COMPLETED = 2  # AskHyperparametersResponse.is_autotune_completed
_DESCRIBE_CURRENT = 2  # DescribeModelResponse.current
_DESCRIBE_BEST = 3  # DescribeModelResponse.best


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def message_field(number: int, encoded: bytes) -> bytes:
    """A length-delimited field ``number`` holding an already encoded message."""
    return _varint(number << 3 | 2) + _varint(len(encoded)) + encoded


def register_response(plan: bytes, completed: bool = False, selection: bytes | None = None) -> bytes:
    """An encoded ``RegisterTensorsResponse`` carrying the encoded plan ``plan`` (and an encoded
    ``AlgorithmSelection``)."""
    return b"".join((message_field(_REGISTER_PLAN, plan),
                     _varint(_REGISTER_COMPLETED << 3) + b"\x01" if completed else b"",
                     message_field(_REGISTER_SELECTION, selection) if selection is not None else b""))


def ask_response(plan: bytes, completed: bool) -> bytes:
    """An encoded ``AskHyperparametersResponse``."""
    return message_field(_ASK_PLAN, plan) + (_varint(_ASK_COMPLETED << 3) + b"\x01" if completed else b"")


def describe_response(rest: Any, current: bytes, best: bytes | None) -> bytes:
    """An encoded ``DescribeModelResponse``: ``rest`` (summary and samples, a message) plus the plans."""
    head = rest.SerializeToString()
    tail = message_field(_DESCRIBE_BEST, best) if best is not None else b""
    return b"".join((head, message_field(_DESCRIBE_CURRENT, current), tail))


def _serialize(response: Any) -> bytes:
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_to_server(servicer: Any, server: Any) -> None:
    """Register ``servicer``'s methods (returning messages or encoded bytes) on a grpc or grpc.aio server."""
    handlers = {}
    for method in _DESCRIPTOR.methods:
        request_type = getattr(pb, method.input_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name), request_deserializer=request_type.FromString,
            response_serializer=_serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    if hasattr(server, "add_registered_method_handlers"):
        server.add_registered_method_handlers(SERVICE, handlers)
