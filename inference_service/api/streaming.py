"""Streaming, written once for every surface: the engine's outputs with heartbeats, and the error
handling of a streamed call.

An error before the first message is a status (REST: an HTTP error in the API's shape). After it,
a caller that asked for in-band errors (the REST gateway's `x-textgen-inband-errors`) gets the
error as a last message, and, where the API has one, a last `done` message (OpenAI's `[DONE]`).
A refusal before admission carries the retry marker either way (`api.errors.RETRYABLE_KEY`): in
the status, or for an in-band error in the headers, where the gateway's retry policy sees it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from inference_service.api.errors import (
    RETRYABLE_KEY,
    StreamHandler,
    abort,
    describe,
    log_failure,
    retryable,
    wants_inband_errors,
)
from inference_service.api.keepalive import requested_interval, with_keepalives
from inference_service.engine.async_engine import AsyncEngine
from inference_service.outputs import RequestOutput
from inference_service.sampling_params import EngineRequest

# (message, error_type) → the API's in-band error message.
ErrorMessage = Callable[[str, str], Any]


def stream_errors(
    error_message: ErrorMessage, *, done_message: Callable[[], Any] | None = None, status_before_first: bool = False
) -> Callable:
    """Wrap a streaming servicer method as the module docstring says; `status_before_first`: an
    error before the first message is a status even for an in-band caller (OpenAI's routes: the
    HTTP error then has OpenAI's shape)."""

    def decorate(handler: StreamHandler) -> StreamHandler:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            inband, sent = wants_inband_errors(context), False
            try:
                # aclosing: a cancelled call closes the handler now, which aborts its engine requests.
                async with contextlib.aclosing(handler(self, request, context)) as messages:
                    async for message in messages:
                        sent = True
                        yield message
            except Exception as error:
                if not inband or (status_before_first and not sent):
                    await abort(context, error, handler.__name__)
                    return
                code, message, error_type = describe(error)
                log_failure(error, code, handler.__name__)
                if not sent and retryable(error):  # refused before admission: the gateway may retry
                    await context.send_initial_metadata(((RETRYABLE_KEY, "1"),))
                yield error_message(message, error_type)
            if inband and done_message is not None:
                yield done_message()

        return wrapper

    return decorate


async def engine_events(
    engine: AsyncEngine, requests: Sequence[EngineRequest], context: grpc.aio.ServicerContext
) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """(request index, output) as they come, and None as a heartbeat when the caller asked for them."""
    async with (
        contextlib.aclosing(engine.stream_all(requests)) as outputs,
        contextlib.aclosing(with_keepalives(outputs, requested_interval(context))) as events,
    ):
        async for event in events:
            yield event
