"""Typed errors: one class per kind of failure, all subclasses of `TextGenerationError`.

The server puts the kind of a failure in the status details (`grpc-status-details-bin`: a
`google.rpc.Status` whose `google.rpc.ErrorInfo.reason` is the kind) and in the `x-error-type`
trailer. The kind picks the class; without one (a proxy, a connection failure) the status code
does. Each error keeps the server's message, the kind (`error_type`) and the status code.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

STATUS_DETAILS_KEY = "grpc-status-details-bin"
ERROR_TYPE_KEY = "x-error-type"
# "1" when no server took the call: a server's refusal before admission (loading, draining, full),
# or the gateway's 503 when no server could be reached. Such a call is safe to send again.
RETRYABLE_KEY = "x-textgen-retryable"
# gRPC's own words for a call that never left the client (no connection, no address).
_UNSENT_DETAILS = ("failed to connect to all addresses", "errors resolving", "DNS resolution failed")


class TextGenerationError(Exception):
    """Base of every error the client raises for a failed call.

    `message` is the server's message (TGI's text, e.g. "Input validation error: ..."),
    `error_type` the kind ("validation", "overloaded", "generation", ...), and `code` the gRPC
    status code (None for an error found before anything was sent). `retryable` is True when no
    server took the call (sending it again cannot run it twice).
    """

    def __init__(self, message: str, error_type: str, code: grpc.StatusCode | None = None, *, retryable: bool = False):
        super().__init__(message)
        self.message = message
        self.error_type = error_type
        self.code = code
        self.retryable = retryable

    def __repr__(self) -> str:
        code = self.code.name if self.code is not None else None
        return f"{type(self).__name__}({self.message!r}, error_type={self.error_type!r}, code={code})"


class ValidationError(TextGenerationError):
    """The request is invalid (a parameter out of range, a prompt too long); fix it, don't retry."""


class OverloadedError(TextGenerationError):
    """The server has `max_concurrent_requests` in flight already; retry later or elsewhere."""


class GenerationError(TextGenerationError):
    """Generation failed inside the server (the model step, sampling, detokenization)."""


class IncompleteGenerationError(TextGenerationError):
    """A stream ended without its final message (no `generated_text`)."""


class UnavailableError(TextGenerationError):
    """No server could take the call: unreachable, still loading, or shutting down."""


class DeadlineExceededError(TextGenerationError):
    """The call's timeout passed before it finished; the server stops generating for it."""


class CancelledError(TextGenerationError):
    """The call was cancelled: by the server (e.g. on shutdown) or by the caller's channel closing."""


class AuthenticationError(TextGenerationError):
    """The server or a proxy in front of it refused the credentials (API key, TLS identity)."""


class UnimplementedError(TextGenerationError):
    """The server does not have this method (an older server, or not a textgen server)."""


class NotFoundError(TextGenerationError):
    """The thing asked for does not exist on the server (e.g. a model id it does not serve)."""


class ConflictError(TextGenerationError):
    """The server's state kept the call from happening now (e.g. unloading a LoRA adapter that
    requests still run on); nothing changed."""


class UnknownError(TextGenerationError):
    """Any other failure, including an unexpected error inside the server."""


_BY_KIND: dict[str, type[TextGenerationError]] = {
    "validation": ValidationError,
    "template_error": ValidationError,  # the chat template refused the messages
    "tool_error": ValidationError,  # the tools or tool_choice are invalid
    "not_found": NotFoundError,
    "overloaded": OverloadedError,
    "generation": GenerationError,
    "incomplete_generation": IncompleteGenerationError,
    "unavailable": UnavailableError,
    "cancelled": CancelledError,
    "deadline_exceeded": DeadlineExceededError,
    "unauthorized": AuthenticationError,
    "conflict": ConflictError,
    "internal": UnknownError,
}

_BY_CODE: dict[grpc.StatusCode, type[TextGenerationError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: ValidationError,
    grpc.StatusCode.OUT_OF_RANGE: ValidationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.INTERNAL: GenerationError,
    grpc.StatusCode.DATA_LOSS: GenerationError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ABORTED: ConflictError,
}


def error_kind(trailing_metadata: object) -> str | None:
    """The server's error kind: ErrorInfo.reason from the status details, else `x-error-type`."""
    pairs = list(trailing_metadata or ())  # type: ignore[call-overload]
    for key, value in pairs:
        if key == STATUS_DETAILS_KEY and isinstance(value, bytes):
            reason = _error_info_reason(value)
            if reason:
                return reason
    for key, value in pairs:
        if key == ERROR_TYPE_KEY and value:
            return value.decode() if isinstance(value, bytes) else str(value)
    return None


def _error_info_reason(serialized_status: bytes) -> str | None:
    status = status_pb2.Status()
    try:
        status.ParseFromString(serialized_status)
    except Exception:  # a proxy's garbage must not hide the status code
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return str(info.reason)
    return None


def from_status(code: grpc.StatusCode, message: str | None, trailing_metadata: object = None) -> TextGenerationError:
    """The typed error of a failed call: chosen by the server's kind, else by the status code."""
    kind = error_kind(trailing_metadata)
    cls = _BY_KIND.get(kind or "") or _BY_CODE.get(code, UnknownError)
    return cls(
        message or code.name, kind or code.name.lower(), code, retryable=_unsent(code, message, trailing_metadata)
    )


def _unsent(code: grpc.StatusCode, message: str | None, trailing_metadata: object) -> bool:
    """Whether no server took the call: it says so (the retry marker), or gRPC never connected."""
    if any(key == RETRYABLE_KEY and value in ("1", b"1") for key, value in trailing_metadata or ()):  # type: ignore[attr-defined]
        return True
    return code == grpc.StatusCode.UNAVAILABLE and (message or "").startswith(_UNSENT_DETAILS)


def from_kind(kind: str, message: str) -> TextGenerationError:
    """The typed error of an in-band stream error (a message with `error` and `error_type`)."""
    return _BY_KIND.get(kind, UnknownError)(message, kind, None)


def from_rpc_error(error: grpc.RpcError) -> TextGenerationError:
    """The typed error of a `grpc.RpcError` (sync or `grpc.aio.AioRpcError`)."""
    call: grpc.Call = error  # type: ignore[assignment]  # every RpcError grpc raises is a Call
    return from_status(call.code(), call.details(), call.trailing_metadata())
