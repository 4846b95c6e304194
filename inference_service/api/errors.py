"""Domain errors → gRPC status, in one place.

Every `InferenceError.error_type` maps to one status code. The status details
(`grpc-status-details-bin`) carry a `google.rpc.ErrorInfo` whose `reason` is the error type, and the
`x-error-type` trailer carries it too, so callers (and the REST gateway) can tell the kinds apart
without parsing messages. Anything that is not an `InferenceError` is a bug: it is logged with its
traceback and answered UNKNOWN, so it is never mistaken for a generation failure (INTERNAL); its
text is not sent (it may name internals).

Every message is bounded here, whatever produced it: it travels in the trailers twice (`grpc-message`,
percent-encoded, and the status details), and a trailer past a hop's header limit (gRPC's 8 KiB by
default) is not one call's failure: the hop resets the HTTP/2 connection, ending every stream on it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from inference_service.errors import InferenceError, UnavailableError
from inference_service.observability.logging import UNAVAILABLE_CHANNEL, log_state

logger = logging.getLogger(__name__)

ERROR_DOMAIN = "textgen.v1"
ERROR_TYPE_KEY = "x-error-type"
STATUS_DETAILS_KEY = "grpc-status-details-bin"
# Set by the REST gateway on GenerateStream: TGI sends stream errors as a last SSE event, not a status.
INBAND_ERRORS_KEY = "x-textgen-inband-errors"
# "1" on a refusal before admission (`InferenceError.retryable`), in the status's metadata (a
# trailers-only response: headers to a proxy) or, for an in-band stream error, in the headers. The
# REST gateway retries on it and nothing else the engine answers; callers may too.
RETRYABLE_KEY = "x-textgen-retryable"
UNEXPECTED_ERROR_TYPE = "internal"
UNEXPECTED_ERROR_MESSAGE = "Unexpected server error"
# UTF-8 bytes of a message: percent-encoded (up to 3x) plus its copy in the details (base64, 4/3x),
# the trailers stay under 5 KiB.
MAX_MESSAGE_BYTES = 1024

STATUS_CODES: dict[str, grpc.StatusCode] = {
    "validation": grpc.StatusCode.INVALID_ARGUMENT,
    "template_error": grpc.StatusCode.INVALID_ARGUMENT,
    "tool_error": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "conflict": grpc.StatusCode.ABORTED,
    "overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "generation": grpc.StatusCode.INTERNAL,
    "cancelled": grpc.StatusCode.CANCELLED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "unauthorized": grpc.StatusCode.UNAUTHENTICATED,
    UNEXPECTED_ERROR_TYPE: grpc.StatusCode.UNKNOWN,
}


def describe(error: Exception) -> tuple[grpc.StatusCode, str, str]:
    """(status code, message, error type) of any exception a handler raised."""
    if isinstance(error, InferenceError):
        error_type = error.error_type if error.error_type in STATUS_CODES else UNEXPECTED_ERROR_TYPE
        return STATUS_CODES[error_type], bounded(error.message), error_type
    return STATUS_CODES[UNEXPECTED_ERROR_TYPE], UNEXPECTED_ERROR_MESSAGE, UNEXPECTED_ERROR_TYPE


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` cut to at most `limit` UTF-8 bytes, with an ellipsis when cut."""
    data = message.encode()
    if len(data) <= limit:
        return message
    return data[: limit - len("…".encode())].decode(errors="ignore") + "…"


def retryable(error: Exception) -> bool:
    """Whether `error` refused the request before the engine admitted it."""
    return isinstance(error, InferenceError) and error.retryable


def trailing_metadata(
    code: grpc.StatusCode, message: str, error_type: str, retryable: bool = False
) -> tuple[tuple[str, Any], ...]:
    """The trailers of a failed call: the rich status (google.rpc.Status + ErrorInfo), the kind, and
    the retry marker on a refusal before admission."""
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=error_type, domain=ERROR_DOMAIN))
    status = status_pb2.Status(code=code.value[0], message=message, details=[info])
    marker = ((RETRYABLE_KEY, "1"),) if retryable else ()
    return ((ERROR_TYPE_KEY, error_type), (STATUS_DETAILS_KEY, status.SerializeToString()), *marker)


def wants_inband_errors(context: grpc.aio.ServicerContext) -> bool:
    return any(key == INBAND_ERRORS_KEY and value == "1" for key, value in (context.invocation_metadata() or ()))


def log_failure(error: Exception, code: grpc.StatusCode, method: str) -> None:
    if isinstance(error, UnavailableError):  # loading or draining: said once per state
        log_state(
            logger,
            UNAVAILABLE_CHANNEL,
            error.message,
            logging.INFO,
            "%s failed: %s (%s)",
            method,
            error.message,
            code.name,
        )
    elif isinstance(error, InferenceError):
        logger.info("%s failed: %s (%s)", method, error.message, code.name)
    else:
        logger.error("%s failed with an unexpected error", method, exc_info=error)


async def abort(context: grpc.aio.ServicerContext, error: Exception, method: str) -> None:
    """End the call with the status that `error` maps to (raises, as `context.abort` does)."""
    code, message, error_type = describe(error)
    log_failure(error, code, method)
    await context.abort(code, message, trailing_metadata(code, message, error_type, retryable(error)))


Request = TypeVar("Request")
Response = TypeVar("Response")
UnaryHandler = Callable[[Any, Request, grpc.aio.ServicerContext], Awaitable[Response]]
StreamHandler = Callable[[Any, Request, grpc.aio.ServicerContext], AsyncIterator[Response]]


def unary_errors(handler: UnaryHandler) -> UnaryHandler:
    """Wrap a unary servicer method: a raised error becomes its status."""

    @functools.wraps(handler)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except Exception as error:
            await abort(context, error, handler.__name__)

    return wrapper
