"""The asyncio front of the engine: one engine thread, one async stream per request.

Model code never runs on the event loop. Callers put typed commands (`engine_commands`) on a
thread-safe queue; the engine thread applies them between steps and hands each step's outputs back to the
callers' event loops in one batch. Closing a stream early (client gone, deadline, `break`)
aborts its request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from inference_service.config import EngineConfig
from inference_service.engine.builder import warm_up
from inference_service.engine.engine_commands import AbortRequest, AddRequest, Command, RunOnEngine, Wake, run_on_engine
from inference_service.engine.isolation import request_error
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.shards import build_engine
from inference_service.engine.step_yield import Arrivals
from inference_service.errors import OverloadedError, RunnerLost, ServerFailed, UnavailableError
from inference_service.outputs import EngineInfo, EngineStats, GenerateResult, RequestOutput, StepStats
from inference_service.sample.grammar import GrammarCompiler
from inference_service.sampling_params import EngineRequest

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5  # the engine thread re-checks for shutdown this often when idle
_FAILURE_POLL_S = 0.1  # how often the server looks whether the engine failed
# Test-only: milliseconds the engine thread sleeps after each step, so a tiny model's request can
# last minutes (the long-request tests). Unset in any real deployment.
STEP_DELAY_ENV = "INFERENCE_SERVICE_TEST_STEP_DELAY_MS"


def _step_delay_s() -> float:
    return float(os.environ.get(STEP_DELAY_ENV) or 0) / 1000


@dataclasses.dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """Thread-safe, asyncio-facing wrapper around `LLMEngine`."""

    def __init__(self, engine: LLMEngine, max_concurrent_requests: int):
        self._engine = engine
        self.info: EngineInfo = engine.info
        self.tokenizer = engine.tokenizer
        self.processor = engine.processor  # a vision-language model's (the front end's), else None
        self.grammar_compiler: GrammarCompiler | None = engine.grammar_compiler  # the front end's
        self.adapters = engine.adapters  # resident LoRA adapters (None: none served)
        self._max_concurrent = max_concurrent_requests
        self._num_in_flight = 0
        self._commands: queue.Queue[Command] = queue.Queue()
        # Requests and aborts on their way to the engine thread: a lone prefill step gives way to them.
        self._arrivals: Arrivals = engine.arrivals
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._draining = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats = engine.stats()
        self._step_delay_s = _step_delay_s()
        # Why the engine can no longer generate (a model shard is gone); None while it can.
        self.failure: str | None = None
        # When (time.monotonic) a request last arrived, admitted or refused: while they keep coming
        # after NOT_SERVING, a gateway has not seen it yet (api/linger.py).
        self.last_arrival_at: float | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model, size the cache and warm up (blocking; raises ModelLoadError)."""
        engine = build_engine(config)
        try:
            warm_up(engine)
        except BaseException:
            engine.close()
            raise
        return cls(engine, config.limits.max_concurrent_requests)

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()

    async def shutdown(self, timeout_s: float, cut: asyncio.Event | None = None) -> int:
        """Stop admitting, let in-flight requests finish for up to `timeout_s` (or until `cut` is
        set: a second Ctrl-C), abort the rest; returns how many were aborted."""
        self._draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._num_in_flight and asyncio.get_running_loop().time() < deadline:
            if cut is not None and cut.is_set():
                break
            await asyncio.sleep(0.05)
        aborted = list(self._streams)
        for request_id in aborted:
            self._queue(AbortRequest(request_id, "server shutting down"))
        while self._streams and asyncio.get_running_loop().time() < deadline + 5:
            await asyncio.sleep(0.02)
        self._stopping.set()
        self._commands.put(Wake())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        return len(aborted)

    async def wait_failed(self) -> str:
        """Return (why) once the engine can no longer generate; never while it can."""
        while self.failure is None:
            await asyncio.sleep(_FAILURE_POLL_S)
        return self.failure

    @property
    def is_draining(self) -> bool:
        return self._draining

    def stats(self) -> EngineStats:
        return self._stats  # refreshed by the engine thread after every step

    def observe_steps(self, observer: Callable[[StepStats], None] | None) -> None:
        """Call `observer` on the engine thread with every step's `StepStats` (metrics)."""
        self._engine.step_observer = observer

    async def on_engine_thread(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """`fn(engine)` run on the engine thread between two steps (never during one)."""
        if self._thread is None or self._stopping.is_set():
            return fn(self._engine)  # no step can be running
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(RunOnEngine(fn, loop, future))
        return await future

    # -- requests -------------------------------------------------------------------------
    async def generate_stream(
        self, request: EngineRequest, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; raises the request's error instead of yielding it."""
        self._admit(1)
        try:
            async for output in self._stream(request, request_id or uuid.uuid4().hex):
                yield output
        finally:
            self._release(1)

    async def generate(self, request: EngineRequest, request_id: str | None = None) -> GenerateResult:
        """The whole generation."""
        self._admit(1)
        try:
            return await self._collect(request, request_id or uuid.uuid4().hex)
        finally:
            self._release(1)

    async def generate_all(
        self, requests: Sequence[EngineRequest], request_id: str | None = None
    ) -> list[GenerateResult]:
        """Several whole generations admitted together, so they decode in the same batches (OpenAI's
        `n`, a list of prompts, TGI's `best_of`); each counts against --max-concurrent-requests."""
        self._admit(len(requests))
        try:
            base_id = request_id or uuid.uuid4().hex
            return list(await asyncio.gather(*(self._collect(r, f"{base_id}-{i}") for i, r in enumerate(requests))))
        finally:
            self._release(len(requests))

    async def stream_all(
        self, requests: Sequence[EngineRequest], request_id: str | None = None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of several generations as they come, each with its request's index. The first
        error ends the whole call (closing it aborts the requests still running)."""
        self._admit(len(requests))
        try:
            base_id = request_id or uuid.uuid4().hex
            streams = [self._stream(r, f"{base_id}-{i}") for i, r in enumerate(requests)]
            # One request (every plain stream): its outputs as they are, without a task and a queue
            # more per token.
            merged = _merged(streams) if len(streams) > 1 else _tagged(streams[0])
            async with contextlib.aclosing(merged) as outputs:
                async for item in outputs:
                    yield item
        finally:
            self._release(len(requests))

    async def _collect(self, request: EngineRequest, request_id: str) -> GenerateResult:
        tokens, top_tokens, prefill = [], [], []
        async for output in self._stream(request, request_id):
            tokens.extend(output.tokens)
            top_tokens.extend(output.top_tokens)
            if output.prefill_tokens:
                prefill = output.prefill_tokens
            if output.finish_reason is not None:  # an error was raised by `_stream`
                return GenerateResult(
                    generated_text=output.generated_text or "",
                    finish_reason=output.finish_reason,
                    num_generated_tokens=output.num_generated_tokens,
                    num_prompt_tokens=output.num_prompt_tokens,
                    seed=output.seed,
                    tokens=tokens,
                    top_tokens=top_tokens,
                    prefill_tokens=prefill,
                    timings=output.timings,
                )
        raise RuntimeError("request stream ended without a final output")

    async def _stream(self, request: EngineRequest, request_id: str) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._queue(AddRequest(request_id, request))
        finished = False
        try:
            while True:
                output: RequestOutput = await stream.queue.get()
                if output.error is not None:
                    finished = True
                    raise output.error
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if not finished:
                self._queue(AbortRequest(request_id, "request cancelled"))
            with self._lock:
                self._streams.pop(request_id, None)

    def _queue(self, command: AddRequest | AbortRequest) -> None:
        """A command that may change the next step's plan: counted as arriving until it is taken."""
        self._arrivals.coming()
        self._commands.put(command)

    def _admit(self, count: int) -> None:
        with self._lock:
            self.last_arrival_at = time.monotonic()
            if self.failure is not None:
                refused = ServerFailed(self.failure)
                refused.retryable = True  # nothing ran: another replica may serve it
                raise refused
            if self._draining or self._stopping.is_set():
                raise UnavailableError("the server is shutting down")
            if self._num_in_flight + count > self._max_concurrent:
                raise OverloadedError()
            self._num_in_flight += count

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_in_flight -= count

    # -- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        engine = self._engine
        while not self._stopping.is_set():
            try:
                if self.failure is None and engine.runner.lost is not None:  # seen while idle
                    raise engine.runner.lost
                self._apply_commands(block=not engine.has_unfinished() or self.failure is not None)
                outputs = engine.step() if engine.has_unfinished() and self.failure is None else []
                if outputs and self._step_delay_s:  # 0 unless a test slows the engine down
                    time.sleep(self._step_delay_s)
            except RunnerLost as error:  # no step can run any more: end everything, refuse the rest
                logger.error("the engine can no longer generate: %s", error)
                self.failure = f"the model can no longer run: {error}"
                outputs = engine.fail_all(ServerFailed(self.failure))
            except Exception:  # noqa: BLE001 — a bug must not kill the engine thread
                logger.exception("engine step failed")
                outputs = engine.fail_all()
            self._stats = engine.stats()
            if outputs:
                self._deliver(outputs)
        for request_id in list(engine.live):
            output = engine.abort_request(request_id, "server shutting down")
            if output is not None:
                self._deliver([output])
        engine.close()

    def _apply_commands(self, block: bool) -> None:
        outputs: list[RequestOutput] = []
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            while True:
                outputs.extend(self._apply(command))
                command = self._commands.get_nowait()
        except queue.Empty:
            pass
        if outputs:
            self._deliver(outputs)

    def _apply(self, command: Command) -> list[RequestOutput]:
        if isinstance(command, AddRequest | AbortRequest):
            self._arrivals.taken()
        if isinstance(command, AddRequest):
            if command.request_id not in self._streams:  # its caller is already gone
                return []
            if self.failure is not None:  # admitted just before the failure
                return [RequestOutput(command.request_id, error=ServerFailed(self.failure))]
            try:
                self._engine.add_request(command.request_id, command.request)
            except Exception as error:  # noqa: BLE001
                logger.exception("could not add request %s", command.request_id)
                return [RequestOutput(command.request_id, error=request_error(error, "starting the request"))]
            return []
        if isinstance(command, AbortRequest):
            output = self._engine.abort_request(command.request_id, command.reason)
            return [output] if output is not None else []
        if isinstance(command, RunOnEngine):
            run_on_engine(command, self._engine)
        return []  # Wake

    def _deliver(self, outputs: list[RequestOutput], here: asyncio.AbstractEventLoop | None = None) -> None:
        """Hand one step's outputs to their callers, one wake-up per event loop; `here`: the loop
        this runs on, whose callers get theirs at once."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            if loop is here:
                _put_all(items)
                continue
            with contextlib.suppress(RuntimeError):  # that loop is closed: its callers are gone
                loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for stream_queue, output in items:
        stream_queue.put_nowait(output)


async def _tagged(stream: AsyncIterator[RequestOutput]) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """The outputs of one stream, tagged with index 0 (closing this closes the stream: an abort)."""
    async with contextlib.aclosing(stream) as outputs:  # type: ignore[type-var]  # an async generator
        async for output in outputs:
            yield 0, output


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """Items of several streams as they come, tagged with the stream's index; each stream is drained
    by its own task, and all of them are cancelled (their requests aborted) when this closes."""
    arrivals: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def drain(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                arrivals.put_nowait((index, output))
            arrivals.put_nowait((index, ended))
        except Exception as error:  # noqa: BLE001 — handed to the consumer
            arrivals.put_nowait((index, error))

    tasks = [asyncio.ensure_future(drain(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            index, item = await arrivals.get()
            if item is ended:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
