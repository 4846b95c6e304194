"""A request message that does not decode is the caller's error: INVALID_ARGUMENT, not UNKNOWN.

grpc.aio decodes a request with its handler's deserializer before the handler runs, and answers
UNKNOWN (which callers read as a server bug) with the decoder's exception text when that raises.
This interceptor gives every unary-request handler a deserializer that keeps the failure instead,
and a behaviour that answers it as a `ValidationError` (the usual status details and trailers)
before the servicer sees anything. Streaming-request methods (only reflection has them) keep grpc's
own handling.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from inference_service.api import errors
from inference_service.errors import ValidationError

UNDECODABLE_MESSAGE = "the request is not a valid protobuf message of this method's request type"


class _Undecodable:
    """What the deserializer returns for bytes that are not a message of the method's type."""


_UNDECODABLE = _Undecodable()


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a unary-request call whose request message does not decode."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return _decoding(handler, details.method.rsplit("/", 1)[-1])


def _decoding(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer

    def safe_deserialize(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception:  # noqa: BLE001 — protobuf's DecodeError, or any failure to decode: the caller's bytes
            return _UNDECODABLE

    async def refuse(context: grpc.aio.ServicerContext) -> None:
        await errors.abort(context, ValidationError(UNDECODABLE_MESSAGE), name)

    codecs = {"request_deserializer": safe_deserialize, "response_serializer": handler.response_serializer}
    if not handler.response_streaming:
        behaviour = handler.unary_unary

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _UNDECODABLE:
                await refuse(context)
            return await behaviour(request, context)

        return grpc.unary_unary_rpc_method_handler(unary, **codecs)
    streaming = handler.unary_stream
    if inspect.isasyncgenfunction(streaming):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if request is _UNDECODABLE:
                await refuse(context)
            async for message in streaming(request, context):
                yield message

        return grpc.unary_stream_rpc_method_handler(stream, **codecs)

    async def writing(request: Any, context: grpc.aio.ServicerContext) -> Any:  # writes with context.write
        if request is _UNDECODABLE:
            await refuse(context)
        return await streaming(request, context)

    return grpc.unary_stream_rpc_method_handler(writing, **codecs)
