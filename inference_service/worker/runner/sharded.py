"""Driving the shards of a tensor-parallel model through one small step message.

Shard 0 (the server: it schedules and samples) runs `ShardedRunner`: each step it broadcasts the
step's `ScheduledRequest`s (token ids, positions, block tables: ints and lists) and runs its own
`ModelRunner` on them. Every other shard runs `follow`: receive the message, run the same step on
its slice (the collectives inside the forward pass meet shard 0's), repeat until told to stop.
Logits reach shard 0 only (the head gathers them there); followers drop theirs.

The runner may be the paged `ModelRunner` (it keeps nothing per request) or the fallback's
`TransformersRunner` (a cache per request): the step message also names the requests released
since the last one, so every shard drops the same caches before the same step and plans its
batches alike.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference_service.errors import RunnerLost
from inference_service.outputs import Runner, ScheduledRequest, StepLogits
from inference_service.worker import step_yield
from inference_service.worker.shard_group import ShardGroup, ShardLost

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Step:
    """Run these scheduled chunks (the same ones shard 0 runs), after releasing `released`."""

    scheduled: list[ScheduledRequest]
    released: tuple[str, ...] = ()


@dataclass(frozen=True)
class Stop:
    """The server is stopping: leave the loop."""


StepMessage = Step | Stop


class ShardedRunner:
    """A `Runner` for shard 0: the step message to every shard, then its own share of the step.

    Once a shard is lost every step raises `ShardLost`, without touching the group again. A step
    that fails on shard 0 for any other reason loses the shards too: the followers may be waiting in
    a collective shard 0 never reached, and nothing can bring them back in step.
    """

    def __init__(self, runner: Runner, group: ShardGroup, on_close: Callable[[], None] | None = None):
        self.runner = runner
        self.group = group
        self.device = runner.device
        self.lost: RunnerLost | None = None  # set here, or by whoever watches the followers' processes
        self._on_close = on_close
        self._released: list[str] = []  # sent with the next step

    def execute(self, scheduled: list[ScheduledRequest]) -> StepLogits:
        released, self._released = tuple(self._released), []
        self._send(Step(scheduled, released))
        try:
            with step_yield.never():  # the followers run the whole step: so must shard 0
                return self.runner.execute(scheduled)
        except ShardLost as error:
            self.lost = error
            raise
        except Exception as error:
            lost = ShardLost(f"a step failed on shard 0, the shards are out of step ({error})")
            self.lost = lost
            raise lost from error

    def release(self, request_id: str) -> None:
        """Release here now, and on the followers before the next step."""
        self.runner.release(request_id)
        self._released.append(request_id)

    def describe(self) -> str:
        return f"{self.runner.describe()}, tensor parallel over {self.group.world_size} shards"

    def close(self) -> None:
        """Tell the followers to stop (they leave their loop), then `on_close` (their processes end)."""
        if self.lost is None:
            with contextlib.suppress(ShardLost):
                self._send(Stop())
        self.runner.close()
        if self._on_close is not None:
            self._on_close()
        self.group.close()

    def _send(self, message: StepMessage) -> None:
        if self.lost is not None:
            raise self.lost
        try:
            self.group.broadcast_object(message, self.device)
        except ShardLost as error:
            self.lost = error
            raise


def follow(runner: Runner, group: ShardGroup) -> None:
    """A follower's loop: run every step shard 0 sends until it says stop (or is gone: ShardLost)."""
    while True:
        message = group.broadcast_object(None, runner.device)
        if isinstance(message, Stop):
            runner.close()
            return
        if not isinstance(message, Step):
            raise TypeError(f"unexpected step message {type(message).__name__}")
        for request_id in message.released:
            runner.release(request_id)
        with torch.inference_mode():
            runner.execute(message.scheduled)
