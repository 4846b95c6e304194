"""SIGINT and SIGTERM as a daemon takes them, in every phase of `serve` and `launch`.

- Before the event loop runs (imports, fetching or converting the model) a signal raises
  `Interrupted` in the main thread; `run_until_stopped` turns it into one log line and exit 0.
- While it runs, `StopSignals` takes them: the first asks for a graceful stop (the model stops
  loading, or in-flight requests drain), a second one during the drain stops at once, cutting the
  requests still running (the server says how many).
- `leave` ends the process without crashing when a thread is still inside torch (see there).

A requested stop exits 0 in every phase, as TGI's launcher and uvicorn do: Kubernetes, systemd
and Docker read 0 as a clean stop. Only a command that could not serve (a model that fails to
load, a port in use, Envoy that keeps dying) exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from inference_service import __version__

logger = logging.getLogger("inference_service.stopping")

SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOAD_THREAD = "model-load"  # api.server loads the model on it
ENGINE_THREAD = "engine"  # engine.async_engine steps the model on it
_TORCH_THREADS = (LOAD_THREAD, ENGINE_THREAD)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived before the event loop took the signals over."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signal_name = signal.Signals(signum).name


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


class StopSignals:
    """The event loop's SIGINT/SIGTERM handlers: `stop` is set by the first, `now` by the next."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.now = asyncio.Event()
        self.name = ""  # the first signal's name, for the log

    @classmethod
    def install(cls) -> StopSignals:
        signals = cls()
        loop = asyncio.get_running_loop()
        for signum in SIGNALS:
            loop.add_signal_handler(signum, signals.received, signum)
        return signals

    def received(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if not self.stop.is_set():
            self.name = name
            self.stop.set()
        elif not self.now.is_set():
            logger.info("%s again: stopping at once", name)
            self.now.set()


def abandon_loading() -> None:
    """The model stops loading: its thread runs on until the process leaves, but logs nothing more,
    so the line saying the command stopped is the last one."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda record: record.threadName != LOAD_THREAD)


def run_until_stopped(command: Callable[[], int], model_id: str) -> int:
    """Run a serving command (`serve`, `launch`): a stop signal before its event loop takes the
    signals over ends it with one line and exit 0 (no traceback); then `leave`."""
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in SIGNALS}
    # The first line comes at once, not after the seconds that importing torch and the server take.
    logger.info("inference-service %s starting: model %s", __version__, model_id)
    try:
        code = command()
    except Interrupted as interrupted:
        logger.info("stopped (%s) before serving", interrupted.signal_name)
        code = 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return leave(code)


def leave(code: int) -> int:
    """`code`, or the process ends here with it when a thread is still inside torch.

    Python 3.11 ends a thread that wakes up while the interpreter shuts down with pthread_exit. In a
    thread coming back from torch's C++ (a model still loading when the signal came, an engine step
    cut short) that unwinds through a frame that may not throw: "terminate called without an active
    exception", SIGABRT, exit status 134. Everything the server owns is closed by now, so then the
    process stops what it started below it (a compiler, a download) and leaves with `os._exit`.
    """
    if not any(thread.name in _TORCH_THREADS and thread.is_alive() for thread in threading.enumerate()):
        return code
    _stop_children()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _stop_children() -> None:
    """SIGTERM every child process still running, with its process group when it leads one (a
    compiler's own children)."""
    for pid in _child_pids():
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGTERM)
            else:
                os.kill(pid, signal.SIGTERM)


def _child_pids() -> set[int]:
    pids: set[int] = set()
    for children in Path("/proc/self/task").glob("*/children"):
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(pid) for pid in children.read_text().split())
    return pids
