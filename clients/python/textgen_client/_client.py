"""`Client`: the blocking face of `AsyncClient`, with no second implementation.

Each `Client` owns a private event loop on a daemon thread and runs the `AsyncClient` methods
there; every public method is derived from its async twin (same signature, same docstring).
The caller's context variables travel with each call, so the OpenTelemetry span that is current
in the calling thread is the one propagated.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

import grpc

from textgen_client._async_client import DEFAULT_TARGET, AsyncClient
from textgen_client._retry import RetryPolicy
from textgen_client._types import Metadata

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class _LoopThread:
    """An event loop running forever on its own daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="textgen-client", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, R]) -> tuple[concurrent.futures.Future[R], list[asyncio.Task[R]]]:
        """Start `coro` on the loop in a copy of the caller's context; (its future, [its task])."""
        future: concurrent.futures.Future[R] = concurrent.futures.Future()
        started: list[asyncio.Task[R]] = []

        def start() -> None:
            if not future.set_running_or_notify_cancel():
                coro.close()
                return
            task = self.loop.create_task(coro)  # copies the current context: the caller's
            started.append(task)
            task.add_done_callback(functools.partial(_settle, future))

        self.loop.call_soon_threadsafe(start, context=contextvars.copy_context())
        return future, started

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def run(self, coro: Coroutine[Any, Any, R]) -> R:
        """Run `coro` on the loop and wait; an interrupt of the wait (Ctrl-C) cancels it."""
        if self.on_loop_thread() or self.loop.is_closed():
            coro.close()
            raise RuntimeError(
                "the client is closed"
                if self.loop.is_closed()
                else "a Client method was called from its own event loop; use AsyncClient there"
            )
        future, started = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            if not future.done():
                self.loop.call_soon_threadsafe(lambda: [task.cancel() for task in started])
            raise

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            self.run(self.loop.shutdown_asyncgens())  # close streams left open
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
        self.loop.close()


def _settle(future: concurrent.futures.Future[R], task: asyncio.Task[R]) -> None:
    if task.cancelled():
        future.set_exception(concurrent.futures.CancelledError())
    elif task.exception() is not None:
        future.set_exception(task.exception())
    else:
        future.set_result(task.result())


class Stream(Generic[T]):
    """A blocking iterator over a streaming call (what `Client.generate_stream` returns).

    Leaving a `for` loop over it early closes it once it is no longer referenced; `close()` or a
    `with` block closes it at once. Closing cancels the call on the server.
    """

    def __init__(self, runner: _LoopThread, responses: AsyncIterator[T]):
        self._runner = runner
        self._responses = responses
        self._closed = False

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        if self._closed:
            raise StopIteration
        try:
            return self._runner.run(_next(self._responses))
        except StopAsyncIteration:
            self._closed = True
            raise StopIteration from None
        except BaseException:
            self._closed = True  # the async generator is finished after an error
            raise

    def close(self) -> None:
        """Stop reading and cancel the call (no-op when the stream is finished)."""
        if not self._closed:
            self._closed = True
            aclose = getattr(self._responses, "aclose", None)
            if aclose is not None and not self._runner.loop.is_closed():
                self._runner.run(aclose())

    def __enter__(self) -> Stream[T]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Garbage collection can run on any thread, even the loop's own: schedule, don't wait.
        if not getattr(self, "_closed", True):
            self._closed = True
            aclose = getattr(self._responses, "aclose", None)
            if aclose is not None and not self._runner.loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile (exit)
                    self._runner.submit(aclose())


# The wrappers take the async method's name, docstring and signature (`inspect.signature` and
# type checkers both see the async method's parameters).
async def _next(responses: AsyncIterator[T]) -> T:
    return await responses.__anext__()


def _blocking(
    method: Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Client, P], R]:
    def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._runner.run(method(self._core, *args, **kwargs))

    functools.update_wrapper(call, method)
    return call


def _blocking_stream(
    method: Callable[Concatenate[AsyncClient, P], AsyncIterator[T]],
) -> Callable[Concatenate[Client, P], Stream[T]]:
    def call(self: Client, /, *args: P.args, **kwargs: P.kwargs) -> Stream[T]:
        return Stream(self._runner, method(self._core, *args, **kwargs))

    functools.update_wrapper(call, method)
    return call


def _close(core: AsyncClient, runner: _LoopThread) -> None:
    if runner.on_loop_thread():  # collected by a callback of its own loop: can't wait there
        runner.loop.stop()
        return
    if not runner.loop.is_closed():
        try:
            runner.run(core.close())
        finally:
            runner.stop()


class Client:
    """Blocking client of a textgen server: `client.generate(...)`,
    `for response in client.generate_stream(...)`.

    It has `AsyncClient`'s constructor and methods, blocking (it runs them on a private event
    loop thread), and is safe to share between threads. Use it as a context manager or call
    `close()` when done.
    """

    # The constructor is the one place that repeats `AsyncClient`'s parameters (type checkers
    # can't derive a class's constructor); a test keeps the two signatures equal.
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = 60.0,
        retry: RetryPolicy | None = None,
        metadata: Metadata | None = None,
        load_balancing: str | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ):
        """Set up a client; nothing connects until the first call. The arguments are
        `AsyncClient`'s (see there)."""
        self._core = AsyncClient(
            target,
            api_key=api_key,
            tls=tls,
            credentials=credentials,
            timeout=timeout,
            retry=retry,
            metadata=metadata,
            load_balancing=load_balancing,
            channel_options=channel_options,
        )
        self._runner = _LoopThread()
        self._finalizer = weakref.finalize(self, _close, self._core, self._runner)

    generate = _blocking(AsyncClient.generate)
    generate_stream = _blocking_stream(AsyncClient.generate_stream)
    tokenize = _blocking(AsyncClient.tokenize)
    info = _blocking(AsyncClient.info)
    health = _blocking(AsyncClient.health)
    chat = _blocking(AsyncClient.chat)
    chat_stream = _blocking_stream(AsyncClient.chat_stream)
    complete = _blocking(AsyncClient.complete)
    complete_stream = _blocking_stream(AsyncClient.complete_stream)
    model = _blocking(AsyncClient.model)
    messages = _blocking(AsyncClient.messages)
    messages_stream = _blocking_stream(AsyncClient.messages_stream)
    count_message_tokens = _blocking(AsyncClient.count_message_tokens)

    @property
    def target(self) -> str:
        """The gRPC target calls go to."""
        return self._core.target

    def close(self) -> None:
        """Close the channel and stop the client's thread; calls in flight are cancelled."""
        self._finalizer()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
