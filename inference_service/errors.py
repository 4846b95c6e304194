"""Domain errors shared by the engine and the API.

Every error a caller can see is one of these; `api.errors` maps each `error_type` to a gRPC
status code in one place, and the REST gateway maps it on to TGI's HTTP status.
"""

from typing import Any

# How much of a caller's value an error message repeats: enough to recognise it, never so much that
# the message (a gRPC trailer, a header through every proxy) grows with what the caller sent.
ECHO_CHARS = 64


def quoted(value: object, limit: int = ECHO_CHARS) -> str:
    """`value`'s repr for an error message, cut to `limit` characters with an ellipsis."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…"


def shortened(text: str, limit: int) -> str:
    """`text` cut to `limit` characters with an ellipsis (a message from a library that may quote input)."""
    return text if len(text) <= limit else f"{text[:limit]}…"


def condensed(text: str, limit: int, line_chars: int = ECHO_CHARS) -> str:
    """A library's multi-line message (a parser's, quoting the input line by line) for a caller: each
    line cut to `line_chars`, blank ones dropped, the whole cut to `limit`. What the parser says
    after the quote ("error: unclosed group") survives a long input."""
    lines = [shortened(line.rstrip(), line_chars) for line in text.splitlines() if line.strip()]
    return shortened("\n".join(lines), limit)


class InferenceError(Exception):
    """Base of the errors a request can end with; `error_type` is machine-readable."""

    error_type = "internal"
    # True only for refusals before the engine admitted the request (overloaded, loading, draining):
    # nothing ran, so a proxy may send it again, elsewhere. Anything that fails after admission is
    # never replayed: the generation may have done work (and been seen) already.
    retryable = False
    # The engine's RequestTimings of the failed request, set by the engine when it got that far
    # (traces show where a failed request spent its time). One error object per request.
    timings: Any = None

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple:
        # Pickled as it is (the engine-core process sends errors): re-running a subclass's __init__
        # on its finished message would prefix it twice.
        return _restored, (type(self), self.args, self.__dict__)


def _restored(cls: type[InferenceError], args: tuple, state: dict) -> InferenceError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class ValidationError(InferenceError):
    """Bad input: wrong parameter, too many tokens. TGI's message, TGI's prefix."""

    error_type = "validation"

    def __init__(self, detail: str):
        super().__init__(f"Input validation error: {detail}")
        self.detail = detail


class TemplateError(ValidationError):
    """The chat template can't render the conversation (or the model has none)."""

    error_type = "template_error"

    def __init__(self, detail: str):
        InferenceError.__init__(self, f"Template error: {detail}")
        self.detail = detail


class ToolError(ValidationError):
    """Bad tool definitions or tool choice (OpenAI's chat `tools`, `tool_choice`)."""

    error_type = "tool_error"

    def __init__(self, detail: str):
        InferenceError.__init__(self, f"Tool error: {detail}")
        self.detail = detail


class NotFoundError(InferenceError):
    """No such resource (a model id that is not the served one)."""

    error_type = "not_found"


class AdapterLoadError(ValidationError):
    """A LoRA adapter that can't be loaded (bad files, shapes, rank, options, or no room): the server
    and the other adapters go on serving."""

    error_type = "validation"

    def __init__(self, detail: str):
        InferenceError.__init__(self, detail)
        self.detail = detail


class AdapterBusyError(InferenceError):
    """An unload that could not happen: requests kept running on the adapter. It keeps serving."""

    error_type = "conflict"


class OverloadedError(InferenceError):
    """More requests in flight than `--max-concurrent-requests` allows."""

    error_type = "overloaded"
    retryable = True  # refused at admission

    def __init__(self, message: str = "Model is overloaded"):
        super().__init__(message)


class GenerationError(InferenceError):
    """A failure inside generation (the model step, sampling, detokenization)."""

    error_type = "generation"

    def __init__(self, detail: str):
        super().__init__(f"Request failed during generation: Server error: {detail}")
        self.detail = detail


class RequestStepError(GenerationError):
    """One request's own part of an engine step failed (its logits processing, sampling, text or
    grammar): that request ends with this error and the step's other requests go on.

    The message names the stage only; the cause, with its traceback, is in the server's log. Its
    error type stays "generation" (TGI's 424), which every surface already maps.
    """

    def __init__(self, stage: str):
        super().__init__(f"{stage} failed for this request")
        self.stage = stage


class RequestCancelled(InferenceError):
    """The request was aborted (client gone, deadline, shutdown) before it finished."""

    error_type = "cancelled"


class UnavailableError(InferenceError):
    """The engine is not serving (still loading, or draining for shutdown)."""

    error_type = "unavailable"
    retryable = True  # raised only before admission (see the engine's `_admit`, `api.backend`)


class UnauthorizedError(InferenceError):
    """A guarded call without the server's API key (`--api-key`)."""

    error_type = "unauthorized"

    def __init__(self, message: str = "Unauthorized: a valid 'authorization: Bearer <api key>' is required"):
        super().__init__(message)


class RunnerLost(RuntimeError):
    """The model can't run another step (a tensor-parallel shard is gone): the engine stops serving,
    every request in flight ends with `ServerFailed`, and new ones are refused with it."""


class ServerFailed(UnavailableError):
    """The server can no longer generate (a model shard failed); it reports NOT_SERVING and exits."""

    retryable = False  # a request in flight may have done work; one refused at admission may go elsewhere


class ModelLoadError(Exception):
    """The model can't be loaded or served exactly; the message says why in one line."""
