"""The typed commands callers send to the engine thread, applied there between two steps.

`AsyncEngine` puts them on its queue; the engine-core client (`core_client`) forwards the same ones
to its process. One type per job, so the engine thread matches on types, never on tuples or strings.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from inference_service.sampling_params import EngineRequest

if TYPE_CHECKING:
    from inference_service.engine.llm_engine import LLMEngine


@dataclasses.dataclass(frozen=True)
class AddRequest:
    request_id: str
    request: EngineRequest


@dataclasses.dataclass(frozen=True)
class AbortRequest:
    request_id: str
    reason: str


@dataclasses.dataclass(frozen=True)
class RunOnEngine:
    """Call `fn` with the LLMEngine on the engine thread, between steps; its result (or error) to `future`."""

    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclasses.dataclass(frozen=True)
class Wake:
    """Nothing to do: wakes an idle engine thread so it sees the shutdown."""


Command = AddRequest | AbortRequest | RunOnEngine | Wake


def run_on_engine(command: RunOnEngine, engine: LLMEngine) -> None:
    """Runs the command's call (on the engine thread) and resolves its future on the caller's loop."""
    try:
        result, error = command.fn(engine), None
    except Exception as caught:  # noqa: BLE001 — handed to the caller
        result, error = None, caught

    def resolve() -> None:
        if command.future.done():
            return
        if error is not None:
            command.future.set_exception(error)
        else:
            command.future.set_result(result)

    with contextlib.suppress(RuntimeError):  # that loop is closed: its caller is gone
        command.loop.call_soon_threadsafe(resolve)
