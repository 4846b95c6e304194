"""The API process's engine when the engine core runs in its own process (core_process.py).

`CoreClient` is an `AsyncEngine`: the same admission, streams and delivery, with the engine thread
replaced by a sender (commands onto the pipe) and a receiver (each step's outputs off it). Started on
an event loop (the server's), the loop itself is the receiver: a step's outputs go from the pipe to
their streams with no thread between, so a token wakes one thread here, not two; the core's OpenMP
threads want both of a small machine's cores, and every wake-up here is taken from them. When the
core process ends unasked (a segfault, the OOM killer, SIGKILL), the receiver ends every call in
flight with `ServerFailed` (gRPC UNAVAILABLE: the gateway's error event) and the client takes its
failed state: NOT_SERVING, and `serve` exits non-zero so whoever runs it restarts it.

The core is forked from the API process before that starts any thread (`CoreClient.fork`), so it
starts in milliseconds and loads the model while the API process opens its port. A process that
already runs threads is not forked (`default_start_method`): an OpenMP pool left by torch work done before
(converting a GGUF file on first use) exists in the child as a barrier no thread will ever reach.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from inference_service.config import EngineConfig
from inference_service.engine import core_process
from inference_service.engine import core_wire as wire
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.builder import make_grammar_compiler
from inference_service.engine.engine_commands import AbortRequest, AddRequest, RunOnEngine, Wake
from inference_service.engine.step_yield import Arrivals
from inference_service.errors import ModelLoadError, ServerFailed
from inference_service.outputs import EngineInfo, EngineStats, RequestOutput, StepStats
from inference_service.sample.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

# Seconds the core gets to close its engine after Stop before it is killed.
CORE_EXIT_S = 10.0
# Seconds a forked child gets for one parallel torch op (milliseconds, unless it hangs).
_FORK_PROBE_S = 5.0


def refusal(config: EngineConfig) -> str | None:
    """Why this config keeps the engine in the API process (None: it can run apart)."""
    if config.model.lora_enabled:
        return "LoRA adapters are loaded and unloaded in the API process's engine"
    if (config.model.num_shard or 1) > 1 or config.model.sharded:
        return "--num-shard starts its own shard processes"
    return None


@dataclass
class _CoreFace:
    """What AsyncEngine reads off an LLMEngine, as the core's Ready told it."""

    info: EngineInfo
    tokenizer: Any
    processor: Any
    grammar_compiler: GrammarCompiler | None
    last_stats: EngineStats
    adapters: None = None
    step_observer: Callable[[StepStats], None] | None = None
    # Counted by the sender's callers for no one: the core counts its own (core_process.py).
    arrivals: Arrivals = field(default_factory=Arrivals)

    def stats(self) -> EngineStats:
        return self.last_stats


class CoreClient(AsyncEngine):
    """An AsyncEngine whose LLMEngine runs in the engine-core process."""

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        conn: multiprocessing.connection.Connection,
        face: _CoreFace,
        max_concurrent_requests: int,
    ):
        super().__init__(face, max_concurrent_requests)  # type: ignore[arg-type]  # the face of one
        self._face = face
        self._process = process
        self._conn = conn
        self._send_lock = threading.Lock()
        self._receiver = threading.Thread(target=self._receive, name="core-receiver", daemon=True)
        self._reading_on: asyncio.AbstractEventLoop | None = None  # the loop that reads the pipe, if one does

    @classmethod
    def fork(cls, config: EngineConfig, start_method: str | None = None) -> CoreStart:
        """Fork the core process now; it loads the model while this process goes on (`CoreStart.wait`).

        Called before this process starts a thread (gRPC's, the model loader's): a fork of a process
        that has imported torch and the engine and runs nothing else is as clean as a fork server's,
        and costs milliseconds instead of a second interpreter's imports. None: `default_start_method()`.
        """
        start_method = start_method or default_start_method()
        context: Any = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            context.set_forkserver_preload([core_process.__name__])
        conn, core_end = context.Pipe()
        process = context.Process(
            target=core_process.core_main, args=(config, core_end, os.getpid()), name="engine-core", daemon=True
        )
        process.start()
        core_end.close()  # the core holds the only other end: its death reads as the pipe's end here
        return CoreStart(process, conn)

    @property
    def core_pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        """Start the sender, and the receiver: the running event loop when there is one (it must
        then outlive the engine, as the server's does), else a thread."""
        if self._thread is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._receiver.start()
            else:
                self._reading_on = loop
                loop.add_reader(self._conn.fileno(), self._on_message)
                loop.add_reader(self._process.sentinel, self._on_core_end)
        super().start()

    def observe_steps(self, observer: Callable[[StepStats], None] | None) -> None:
        self._face.step_observer = observer  # called by the receiver (thread or loop) with the core's steps

    async def on_engine_thread(self, fn: Callable[..., Any]) -> Any:
        raise RuntimeError("the engine runs in the engine-core process: nothing runs on its thread here")

    # -- the sender (AsyncEngine's engine thread) -----------------------------------------------
    def _run(self) -> None:
        while True:
            command = self._commands.get()
            if isinstance(command, Wake):
                if self._stopping.is_set():
                    break
            elif isinstance(command, AddRequest):
                if command.request_id not in self._streams:  # its caller is already gone
                    continue
                if self.failure is not None:  # admitted just before the core died
                    self._deliver([RequestOutput(command.request_id, error=ServerFailed(self.failure))])
                    continue
                self._send(wire.AddRequest(command.request_id, wire.for_wire(command.request)))
            elif isinstance(command, AbortRequest):
                self._send(wire.AbortRequest(command.request_id, command.reason))
            elif isinstance(command, RunOnEngine):
                command.loop.call_soon_threadsafe(_refuse, command.future)
        self._send(wire.Stop())
        self._process.join(CORE_EXIT_S)
        _end(self._process)

    def _send(self, message: wire.ToCore) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except OSError:  # the core is gone: the receiver says so to every caller
            pass

    # -- the receiver ----------------------------------------------------------------------------
    def _receive(self) -> None:
        """The receiver thread (no event loop started the client)."""
        while True:
            readable = multiprocessing.connection.wait([self._conn, self._process.sentinel])
            if self._conn not in readable:
                break  # the core ended and left nothing unread
            try:
                message: wire.FromCore = self._conn.recv()
            except (EOFError, OSError):
                break
            self._take(message, None)
        if not self._stopping.is_set():
            self._lost()

    def _on_message(self) -> None:
        """The pipe is readable (on the reading loop): one message, or its end."""
        try:
            message: wire.FromCore = self._conn.recv()
        except (EOFError, OSError):
            self._stop_reading()
            return
        self._take(message, self._reading_on)

    def _on_core_end(self) -> None:
        """The core process ended (on the reading loop): done once the pipe holds nothing unread."""
        if not self._conn.poll():  # what is left (or the pipe's end) is `_on_message`'s
            self._stop_reading()

    def _stop_reading(self) -> None:
        loop, self._reading_on = self._reading_on, None
        if loop is None:
            return
        loop.remove_reader(self._conn.fileno())
        loop.remove_reader(self._process.sentinel)
        if not self._stopping.is_set():  # `_lost` waits for the process: not on the loop
            threading.Thread(target=self._lost, name="core-lost", daemon=True).start()

    def _take(self, message: wire.FromCore, loop: asyncio.AbstractEventLoop | None) -> None:
        """One message from the core; `loop`: the event loop this runs on (its streams get their
        outputs at once)."""
        if isinstance(message, wire.Outputs):
            self._face.last_stats = self._stats = message.stats
            observer = self._face.step_observer
            if observer is not None:
                for step in message.steps:
                    observer(step)
            if message.outputs:
                self._deliver(message.outputs, loop)
        elif isinstance(message, wire.Failed):
            self.failure = message.reason

    def _lost(self) -> None:
        """The core process ended unasked: every call in flight ends with ServerFailed, new ones are refused."""
        self._process.join(1)
        reason = f"the engine core process {_how_it_ended(self._process.exitcode)}"
        logger.error("the engine can no longer generate: %s", reason)
        with self._lock:
            self.failure = self.failure or f"the model can no longer run: {reason}"
            request_ids = list(self._streams)
        self._deliver([RequestOutput(request_id, error=ServerFailed(self.failure)) for request_id in request_ids])


@dataclass
class CoreStart:
    """A core process loading the model."""

    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection

    def wait(self, config: EngineConfig) -> CoreClient:
        """The engine once the core has loaded and warmed up the model (blocking; raises
        ModelLoadError with the core's reason)."""
        try:
            ready = _wait_ready(self.conn, self.process)
        except BaseException:
            _end(self.process)
            raise
        compiler = (
            None
            if config.limits.disable_grammar_support
            else make_grammar_compiler(ready.tokenizer, ready.info, config.limits)
        )
        face = _CoreFace(ready.info, ready.tokenizer, ready.processor, compiler, ready.stats)
        logger.info("the engine core runs in process %d", self.process.pid)
        return CoreClient(self.process, self.conn, face, config.limits.max_concurrent_requests)


def _wait_ready(
    conn: multiprocessing.connection.Connection, process: multiprocessing.process.BaseProcess
) -> wire.Ready:
    readable = multiprocessing.connection.wait([conn, process.sentinel])
    message: wire.FromCore | None = None
    if conn in readable:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = None
    if isinstance(message, wire.Ready):
        return message
    if isinstance(message, wire.LoadFailed):
        raise ModelLoadError(message.message)
    process.join(1)
    raise ModelLoadError(f"the engine core process {_how_it_ended(process.exitcode)} while loading the model")


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _end(process: multiprocessing.process.BaseProcess) -> None:
    if process.is_alive():
        process.kill()
    process.join(CORE_EXIT_S)


def _refuse(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(RuntimeError("the engine runs in the engine-core process"))


def default_start_method() -> str:
    """ "fork" when a forked child can run OpenMP, else "forkserver".

    A fork copies one thread. libgomp's pool (made by the first parallel torch op in this process,
    e.g. converting a GGUF file before serving) is not copied, but libgomp in the child still counts
    on it: the child's first parallel op waits at a barrier for good. So a throwaway child tries one
    parallel op first; a fork server (a fresh process: it costs the imports) when it does not end.
    """
    probe = os.fork()
    if probe == 0:  # the child: one parallel op, then out at once (no interpreter teardown)
        try:
            torch.set_num_threads(max(2, torch.get_num_threads()))
            torch.ones(1 << 18).sum()
        finally:
            os._exit(0)
    deadline = time.monotonic() + _FORK_PROBE_S
    while time.monotonic() < deadline:
        pid, _ = os.waitpid(probe, os.WNOHANG)
        if pid:
            return "fork"
        time.sleep(0.005)
    os.kill(probe, signal.SIGKILL)
    os.waitpid(probe, 0)
    logger.info("OpenMP has run in this process (a forked child would hang): the engine core starts from a fork server")
    return "forkserver"


def loader_for(config: EngineConfig) -> Callable[[EngineConfig], AsyncEngine]:
    """How `serve` loads this config's engine: in a core process forked now, unless the config keeps
    the engine in this one (`refusal`)."""
    reason = refusal(config)
    if reason is not None:
        logger.info("the engine runs in the API process: %s", reason)
        return AsyncEngine.from_config
    return CoreClient.fork(config).wait
