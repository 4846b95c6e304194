"""Domain errors → gRPC status codes, ErrorInfo details and the x-error-type trailer."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from inference_service.api import errors
from inference_service.errors import (
    GenerationError,
    InferenceError,
    OverloadedError,
    RequestCancelled,
    UnavailableError,
    ValidationError,
)


@pytest.mark.parametrize(
    ("error", "code", "error_type"),
    [
        (ValidationError("`top_k` must be strictly positive"), grpc.StatusCode.INVALID_ARGUMENT, "validation"),
        (OverloadedError(), grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded"),
        (GenerationError("CUDA out of memory"), grpc.StatusCode.INTERNAL, "generation"),
        (RequestCancelled("server shutting down"), grpc.StatusCode.CANCELLED, "cancelled"),
        (UnavailableError("the model is still loading"), grpc.StatusCode.UNAVAILABLE, "unavailable"),
        (InferenceError("base"), grpc.StatusCode.UNKNOWN, "internal"),
    ],
)
def test_each_kind_has_its_code(error, code, error_type):
    described_code, message, described_type = errors.describe(error)
    assert (described_code, described_type) == (code, error_type)
    assert str(error) in message


def test_a_bug_is_unknown_and_its_text_is_not_sent():
    """An exception that is no InferenceError may name internals: the log has it, the caller does not."""
    code, message, error_type = errors.describe(ZeroDivisionError("division by zero in kernel.cu"))
    assert (code, error_type) == (grpc.StatusCode.UNKNOWN, "internal")
    assert message == "Unexpected server error"


@pytest.mark.parametrize("char", ["x", "é", "東", "😀"])
def test_every_message_is_bounded_at_a_character_boundary(char):
    """A message repeating 100 KB of input keeps the trailers small: at most MAX_MESSAGE_BYTES of UTF-8,
    cut with an ellipsis, still valid text; short messages are untouched."""
    code, message, _ = errors.describe(ValidationError(char * 100_000))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert len(message.encode()) <= errors.MAX_MESSAGE_BYTES and message.endswith("…")
    assert message.startswith("Input validation error: " + char * 10)
    trailers = dict(errors.trailing_metadata(code, message, "validation"))
    assert len(trailers[errors.STATUS_DETAILS_KEY]) < 2 * errors.MAX_MESSAGE_BYTES
    assert errors.describe(ValidationError(char * 10))[1] == "Input validation error: " + char * 10


def test_messages_keep_tgi_prefixes():
    assert errors.describe(ValidationError("x"))[1] == "Input validation error: x"
    assert errors.describe(OverloadedError())[1] == "Model is overloaded"
    assert errors.describe(GenerationError("boom"))[1] == ("Request failed during generation: Server error: boom")


def test_generation_failure_and_bug_are_told_apart():
    assert errors.describe(GenerationError("x"))[0] != errors.describe(RuntimeError("x"))[0]


def test_trailers_carry_status_details_and_kind():
    trailers = dict(errors.trailing_metadata(grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded", "overloaded"))
    assert trailers[errors.ERROR_TYPE_KEY] == "overloaded"
    status = status_pb2.Status.FromString(trailers[errors.STATUS_DETAILS_KEY])
    assert status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert status.message == "Model is overloaded"
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("overloaded", "textgen.v1")
