"""A request that is not one whole, decodable message is the caller's error: INVALID_ARGUMENT, not
UNKNOWN, and never a hang.

grpc.aio decodes a request with its handler's deserializer before the handler runs, and answers
UNKNOWN (which callers read as a server bug) with the decoder's exception text when that raises.
This interceptor gives every unary-request handler a deserializer that keeps the failure instead,
and a behaviour that answers it as a `ValidationError` (the usual status details and trailers)
before the servicer sees anything. Streaming-request methods (only reflection has them) keep grpc's
own handling.

And grpc.aio waits for a unary request's message until the caller gives up when the stream ends
without one (an empty body, a message cut short, a length prefix past the end): the call hangs,
holding its stream. `WholeMessageInterceptor` receives every unary request as a request stream, where
the end shows, and answers such a call at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from inference_service.api import errors
from inference_service.errors import ValidationError

UNDECODABLE_MESSAGE = "the request is not a valid protobuf message of this method's request type"
INCOMPLETE_MESSAGE = "the request ended before one whole gRPC message arrived"


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


class WholeMessageInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT at once to a unary-request call whose stream ends before a whole
    message. It must be the first interceptor: it reshapes the handler every other one built."""

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        return _whole_message(handler, details.method.rsplit("/", 1)[-1])


def _whole_message(handler: grpc.RpcMethodHandler, name: str) -> grpc.RpcMethodHandler:
    """The same method received as a request stream of which it takes the first message."""

    async def first(context: grpc.aio.ServicerContext) -> Any:
        message = await context.read()
        if message is grpc.aio.EOF:
            await errors.abort(context, ValidationError(INCOMPLETE_MESSAGE), name)
        return message

    async def settle(result: Any) -> Any:
        return await result if inspect.isawaitable(result) else result

    codecs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if not handler.response_streaming:
        behaviour = handler.unary_unary

        async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            return await settle(behaviour(await first(context), context))

        return grpc.stream_unary_rpc_method_handler(unary, **codecs)
    streaming = handler.unary_stream
    if inspect.isasyncgenfunction(streaming):

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for message in streaming(await first(context), context):
                yield message

        return grpc.stream_stream_rpc_method_handler(stream, **codecs)

    async def writing(requests: Any, context: grpc.aio.ServicerContext) -> Any:  # writes with context.write
        return await settle(streaming(await first(context), context))

    return grpc.stream_stream_rpc_method_handler(writing, **codecs)
