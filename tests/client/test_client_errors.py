"""Status codes and error details → typed exceptions (no server)."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from textgen_client import (
    AuthenticationError,
    CancelledError,
    ConflictError,
    DeadlineExceededError,
    GenerationError,
    IncompleteGenerationError,
    NotFoundError,
    OverloadedError,
    TextGenerationError,
    UnavailableError,
    UnimplementedError,
    UnknownError,
    ValidationError,
)
from textgen_client.errors import from_kind, from_status

Code = grpc.StatusCode


def _details(code: Code, message: str, reason: str) -> bytes:
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="textgen.v1"))
    return status_pb2.Status(code=code.value[0], message=message, details=[info]).SerializeToString()


def _trailers(code: Code, message: str, kind: str) -> tuple:
    """What the server sends: the kind in the status details and in `x-error-type`."""
    return (("x-error-type", kind), ("grpc-status-details-bin", _details(code, message, kind)))


@pytest.mark.parametrize(
    ("kind", "code", "cls"),
    [
        ("validation", Code.INVALID_ARGUMENT, ValidationError),
        ("template_error", Code.INVALID_ARGUMENT, ValidationError),
        ("tool_error", Code.INVALID_ARGUMENT, ValidationError),
        ("not_found", Code.NOT_FOUND, NotFoundError),
        ("overloaded", Code.RESOURCE_EXHAUSTED, OverloadedError),
        ("generation", Code.INTERNAL, GenerationError),
        ("cancelled", Code.CANCELLED, CancelledError),
        ("unavailable", Code.UNAVAILABLE, UnavailableError),
        ("internal", Code.UNKNOWN, UnknownError),
    ],
)
def test_server_kinds(kind, code, cls):
    error = from_status(code, "the server's words", _trailers(code, "the server's words", kind))
    assert type(error) is cls and isinstance(error, TextGenerationError)
    assert (error.message, error.error_type, error.code) == ("the server's words", kind, code)
    assert str(error) == "the server's words"


def test_the_kind_wins_over_the_code():
    trailers = (("grpc-status-details-bin", _details(Code.UNKNOWN, "m", "overloaded")),)
    error = from_status(Code.UNKNOWN, "m", trailers)
    assert type(error) is OverloadedError


def test_the_trailer_alone_names_the_kind():
    assert type(from_status(Code.UNKNOWN, "m", (("x-error-type", "validation"),))) is ValidationError
    assert type(from_status(Code.UNKNOWN, "m", (("x-error-type", b"generation"),))) is GenerationError


def test_the_server_module_and_the_client_agree():
    """The server's own trailer builder, read back by the client, for every kind it can send."""
    server_errors = pytest.importorskip("inference_service.api.errors")
    for kind, code in server_errors.STATUS_CODES.items():
        error = from_status(code, "m", server_errors.trailing_metadata(code, "m", kind))
        assert error.error_type == kind and error.code == code
        assert type(error) is not UnknownError or kind == "internal"
        assert type(error) is type(from_status(code, "m"))  # the kind's class is its status code's


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (Code.INVALID_ARGUMENT, ValidationError),
        (Code.OUT_OF_RANGE, ValidationError),
        (Code.RESOURCE_EXHAUSTED, OverloadedError),
        (Code.INTERNAL, GenerationError),
        (Code.UNAVAILABLE, UnavailableError),
        (Code.DEADLINE_EXCEEDED, DeadlineExceededError),
        (Code.CANCELLED, CancelledError),
        (Code.UNAUTHENTICATED, AuthenticationError),
        (Code.PERMISSION_DENIED, AuthenticationError),
        (Code.UNIMPLEMENTED, UnimplementedError),
        (Code.NOT_FOUND, NotFoundError),
        (Code.UNKNOWN, UnknownError),
        (Code.ABORTED, ConflictError),
    ],
)
def test_without_details_the_code_decides(code, cls):
    """A proxy or the channel itself (connection refused, deadline) sends no ErrorInfo."""
    error = from_status(code, None, None)
    assert type(error) is cls
    assert error.error_type == code.name.lower() and error.message == code.name


def test_unknown_kind_and_broken_details_fall_back_to_the_code():
    assert type(from_status(Code.UNAVAILABLE, "m", (("x-error-type", "brand_new"),))) is UnavailableError
    garbage = (("grpc-status-details-bin", b"\xff\x00garbage"),)
    assert type(from_status(Code.INTERNAL, "m", garbage)) is GenerationError


def test_inband_stream_errors():
    error = from_kind("overloaded", "Model is overloaded")
    assert type(error) is OverloadedError and error.code is None
    assert type(from_kind("incomplete_generation", "m")) is IncompleteGenerationError
    assert type(from_kind("whatever", "m")) is UnknownError
