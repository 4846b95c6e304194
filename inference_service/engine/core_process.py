"""The engine-core process: a replica's scheduler and model loop, apart from its API process.

What vLLM calls EngineCore and TGI its shards. The API process (gRPC, front end, tokenization) starts
this process (core_client.py), and when it dies — a segfault, the OOM killer, SIGKILL — the API
process is still there to end every call in flight with a typed UNAVAILABLE and report NOT_SERVING,
which a process that dies whole cannot do.

Two threads: the receiver reads commands off the pipe, the engine loop applies them between steps and
sends each step's outputs back in one message. A request with a grammar waits for its compilation on
a thread of its own (llguidance drops the GIL): a grammar never holds a step, nor the commands behind
it (compiled in the receiver, one that took its whole budget held every request sent after it). The
pipe's end is the API process's end: the core exits with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import Connection

from inference_service.config import EngineConfig
from inference_service.engine import core_wire as wire
from inference_service.engine.async_engine import STEP_DELAY_ENV
from inference_service.engine.builder import warm_up
from inference_service.engine.gc_pauses import freeze_loaded_objects
from inference_service.engine.host_heap import cap_arenas
from inference_service.engine.isolation import request_error
from inference_service.engine.llm_engine import LLMEngine
from inference_service.engine.shards import build_engine, exit_with
from inference_service.engine.slow_turns import SlowTurns
from inference_service.errors import ModelLoadError, RunnerLost, ServerFailed, ValidationError
from inference_service.outputs import RequestOutput, StepStats
from inference_service.sample.grammar import GrammarSpec

logger = logging.getLogger(__name__)

NOT_HANDED_OVER = (
    "the model's tokenizer or processor can't be handed to the API process; serve it with --engine-core-process false"
)
_IDLE_WAIT_S = 0.5  # the idle loop re-checks the pipe's end this often
_NOTHING = object()  # no command came


def core_main(config: EngineConfig, conn: Connection, api_pid: int) -> None:
    """The process's body: load, say Ready (or LoadFailed), serve commands until Stop or the pipe ends."""
    # A Ctrl-C reaches the whole process group: it is the API process's to act on (it drains, then
    # sends Stop). SIGTERM ends the core at once, as it did before the API process took the signals
    # over (forked, the core inherits its handlers): what is sent to the core alone (the API process
    # leaving while the model loads, multiprocessing's own cleanup) must stop it, and quietly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    cap_arenas()  # a forkserver's child starts with the C library's defaults (host_heap.py)
    # Never outlive the API process, even while loading (the pipe is read only once serving).
    threading.Thread(target=exit_with, args=(api_pid,), name="api-watcher", daemon=True).start()
    try:
        engine = build_engine(config)
        try:
            warm_up(engine)
        except BaseException:
            engine.close()
            raise
    except ModelLoadError as error:
        _send(conn, wire.LoadFailed(str(error)))
        os._exit(1)
    except BaseException as error:  # noqa: BLE001 — said once, here and to the API process
        logger.exception("the engine core could not load the model")
        _send(conn, wire.LoadFailed(f"the model could not be loaded: {error}"))
        os._exit(1)
    try:
        conn.send(wire.Ready(engine.info, engine.tokenizer, engine.processor, engine.stats()))
    except OSError:  # the API process is gone
        os._exit(1)
    except Exception as error:  # noqa: BLE001 — a tokenizer or processor that can't be pickled
        _send(conn, wire.LoadFailed(f"{NOT_HANDED_OVER}: {error}"))
        os._exit(1)
    freeze_loaded_objects()  # full collections skip the loaded model's objects (gc_pauses.py)
    CoreLoop(engine, conn).run()
    os._exit(0)  # no interpreter teardown: the atexit handlers inherited from the API process are not ours


def _send(conn: Connection, message: wire.FromCore) -> None:
    with contextlib.suppress(OSError):  # the API process is gone: the receiver sees the pipe's end
        conn.send(message)


class CoreLoop:
    """The engine loop of the core process (AsyncEngine's engine thread, with a pipe for its callers)."""

    def __init__(self, engine: LLMEngine, conn: Connection):
        self.engine = engine
        self.conn = conn
        self.commands: queue.Queue[wire.ToCore | None] = queue.Queue()  # None: the pipe ended
        self.failure: str | None = None
        self._send_lock = threading.Lock()  # the loop, the receiver and grammar threads send
        # Requests whose grammar is compiling → whether an abort came for them meanwhile.
        self._compiling: dict[str, bool] = {}
        self._compiling_lock = threading.Lock()
        self.steps: list[StepStats] = []  # since the last Outputs (a new list after each send)
        self.stats = engine.stats()  # the last step's, for the receiver (which must not read a stepping engine)
        engine.step_observer = self._observe
        self.step_delay_s = float(os.environ.get(STEP_DELAY_ENV) or 0) / 1000
        self.turns = SlowTurns()  # logs a turn that held every stream (slow_turns.py)
        self.num_commands = 0

    def _observe(self, step: StepStats) -> None:
        self.steps.append(step)  # the list of now: `run` hands each one over whole

    def send(self, message: wire.FromCore) -> None:
        with self._send_lock:
            _send(self.conn, message)

    def run(self) -> None:
        threading.Thread(target=self._receive, name="core-receiver", daemon=True).start()
        engine = self.engine
        stopping = False
        while not stopping:
            outputs: list[RequestOutput] = []
            # Waiting idle is no part of a turn: a turn is timed from its first command or its step.
            first = self._wait() if not engine.has_unfinished() or self.failure is not None else _NOTHING
            self.turns.start()
            commands_started, num_commands, commands_s = time.perf_counter(), self.num_commands, 0.0
            try:
                stopping = self._apply_commands(outputs, first)
                commands_s = time.perf_counter() - commands_started
                if self.failure is None and engine.runner.lost is not None:
                    raise engine.runner.lost
                if not stopping and engine.has_unfinished() and self.failure is None:
                    outputs.extend(engine.step())
                    if self.step_delay_s:  # 0 unless a test slows the engine down
                        time.sleep(self.step_delay_s)
            except RunnerLost as error:
                logger.error("the engine can no longer generate: %s", error)
                self.failure = f"the model can no longer run: {error}"
                outputs.extend(engine.fail_all(ServerFailed(self.failure)))
            except Exception:  # noqa: BLE001 — a bug must not end the core
                logger.exception("engine step failed")
                outputs.extend(engine.fail_all())
            steps: list[StepStats] = []
            if outputs or self.steps:
                steps, self.steps = self.steps, []
                self.stats = engine.stats()
                self.send(wire.Outputs(outputs, self.stats, steps))
            self.turns.end(steps, commands_s, self.num_commands - num_commands)
            if self.failure is not None:
                self.send(wire.Failed(self.failure))
                stopping = True
        for request_id in list(engine.live):
            engine.abort_request(request_id, "server shutting down")
        self.turns.gc_clock.close()
        engine.close()

    def _wait(self) -> wire.ToCore | None | object:
        """The next command, waited for a while (_NOTHING if none came)."""
        try:
            return self.commands.get(timeout=_IDLE_WAIT_S)
        except queue.Empty:
            return _NOTHING

    def _apply_commands(self, outputs: list[RequestOutput], first: wire.ToCore | None | object = _NOTHING) -> bool:
        """Apply `first` (unless _NOTHING) and the commands waiting; True on Stop or the pipe's end."""
        command = first
        try:
            while True:
                if command is None or isinstance(command, wire.Stop):
                    return True
                if command is not _NOTHING:
                    self.num_commands += 1
                    outputs.extend(self._apply(command))  # type: ignore[arg-type]
                command = self.commands.get_nowait()
        except queue.Empty:
            return False

    def _apply(self, command: wire.AddRequest | wire.AbortRequest) -> list[RequestOutput]:
        self.engine.arrivals.taken()
        if isinstance(command, wire.AbortRequest):
            output = self.engine.abort_request(command.request_id, command.reason)
            return [output] if output is not None else []
        try:
            self.engine.add_request(command.request_id, command.request)
        except Exception as error:  # noqa: BLE001
            logger.exception("could not add request %s", command.request_id)
            return [RequestOutput(command.request_id, error=request_error(error, "starting the request"))]
        return []

    def _receive(self) -> None:
        """Read commands until the pipe ends; a grammar is compiled here, never on the engine loop."""
        while True:
            try:
                command: wire.ToCore = self.conn.recv()
            except (EOFError, OSError):  # the API process is gone: stop with it
                self.commands.put(None)
                return
            if isinstance(command, wire.AddRequest) and isinstance(command.request.grammar, GrammarSpec):
                with self._compiling_lock:
                    self._compiling[command.request_id] = False
                threading.Thread(target=self._compile_then_queue, args=(command,), daemon=True).start()
                continue
            if isinstance(command, wire.AbortRequest):
                with self._compiling_lock:
                    if command.request_id in self._compiling:
                        self._compiling[command.request_id] = True
            self._queue(command)

    def _queue(self, command: wire.ToCore | None) -> None:
        if isinstance(command, wire.AddRequest | wire.AbortRequest):  # a lone prefill step gives way to it
            self.engine.arrivals.coming()
        self.commands.put(command)

    def _compile_then_queue(self, command: wire.AddRequest) -> None:
        """Queue the request once its grammar is compiled (not at all if it was aborted meanwhile: its
        abort went ahead of it); a failure is its answer."""
        try:
            command = self._compiled(command)
        except Exception as error:  # noqa: BLE001 — checked by the API process already; said, not raised
            with self._compiling_lock:
                aborted = self._compiling.pop(command.request_id, False)
            if not aborted:
                failure = request_error(error, "compiling its grammar")
                self.send(wire.Outputs([RequestOutput(command.request_id, error=failure)], self.stats, []))
            return
        with self._compiling_lock:  # an abort read after this finds it queued, and goes behind it
            if not self._compiling.pop(command.request_id, False):
                self._queue(command)

    def _compiled(self, command: wire.AddRequest) -> wire.AddRequest:
        compiler = self.engine.grammar_compiler
        spec = command.request.grammar
        if compiler is None or not isinstance(spec, GrammarSpec):
            raise ValidationError("grammar support is off on this server")
        request = dataclasses.replace(command.request, grammar=compiler.compile(spec))
        return wire.AddRequest(command.request_id, request)
