"""`--api-key`: the generation calls require `authorization: Bearer <key>`, as TGI's routes do, or
`x-api-key: <key>` (Anthropic's header; the key exactly).

TGI guards generation and tokenization only (`/`, `/invocations`, `/generate`, `/generate_stream`,
`/tokenize`, `/v1/chat/completions`, `/v1/completions`); health, info, metrics and the model list
stay open, so probes and dashboards need no key. The comparison is TGI's: the whole header value,
case-insensitively. Through the gateway the HTTP `Authorization` header arrives as this metadata,
and a refusal becomes TGI's bare 401 (OpenAI's routes: a 401 with OpenAI's error object).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from inference_service.api import errors
from inference_service.errors import UnauthorizedError
from textgen.v1 import generate_pb2

_SERVICE = generate_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
GUARDED_METHODS = frozenset(
    f"/{_SERVICE}/{name}"
    for name in (
        "Generate",
        "GenerateStream",
        "CompatGenerate",
        "Tokenize",
        "ChatCompletion",
        "ChatCompletionStream",
        "Completion",
        "CompletionStream",
        "Messages",
        "MessagesStream",
        "CountMessageTokens",
        "CreateResponse",
        "CreateResponseStream",
        "GetResponse",
        "DeleteResponse",
        "LoadLoraAdapter",
        "UnloadLoraAdapter",
    )
)


_KEY_HEADERS = ("authorization", "x-api-key")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to a guarded call with neither `authorization: Bearer <key>` nor
    `x-api-key: <key>`."""

    def __init__(self, api_key: str):
        self._expected = f"bearer {api_key}".lower().encode()
        self._key = api_key.encode()

    def authorized(self, metadata: Any) -> bool:
        values = {k: v.decode() if isinstance(v, bytes) else v for k, v in (metadata or ()) if k in _KEY_HEADERS}
        bearer = hmac.compare_digest(values.get("authorization", "").lower().encode(), self._expected)
        # Anthropic's header: the key itself
        key = "x-api-key" in values and hmac.compare_digest(values["x-api-key"].encode(), self._key)
        return bearer or key

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        if handler is None or details.method not in GUARDED_METHODS or self.authorized(details.invocation_metadata):
            return handler
        return _refusing(handler, details.method)


def _refusing(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that only refuses (the request is never looked at)."""
    name = method.rsplit("/", 1)[-1]

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await errors.abort(context, UnauthorizedError(), name)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext):
        await errors.abort(context, UnauthorizedError(), name)
        yield  # never reached: makes this the async generator a streaming handler must be

    codecs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **codecs)
    return grpc.unary_unary_rpc_method_handler(refuse, **codecs)
