"""Says in the log when one turn of the engine loop held every stream: its commands, its step and
the send of its outputs took longer than a bound, and where that time went.

Every running request waits for the whole turn, so a slow one shows up as all streams slow at the same
moment. The line tells an operator which of the usual causes it was: the step's own work (its forward
pass and sampling, with its prefill and decode rows), the commands applied before it (requests added
or aborted), a garbage collection, or the thread being off the CPU (thread_marks.py).

The bound is relative, so that a model whose every step is slow is not logged at every step: a turn
slower than SLOW_RATIO times the average turn, and at least MIN_SLOW_S, that carried a stream's token
(a step of prompts alone keeps no stream waiting).
"""

from __future__ import annotations

import logging

from inference_service.engine.gc_pauses import GcClock
from inference_service.engine.thread_marks import ThreadMarks
from inference_service.outputs import StepStats

logger = logging.getLogger(__name__)

MIN_SLOW_S = 0.05
SLOW_RATIO = 4.0
SMOOTHING = 0.05  # the weight of the newest turn in the average


class SlowTurns:
    """Times the engine loop's turns (call `start`, then `end` with the steps it ran) and logs the slow ones."""

    def __init__(self, gc_clock: GcClock | None = None):
        self.gc_clock = gc_clock or GcClock()
        self.average_s: float | None = None
        self.num_slow = 0
        self._marks: ThreadMarks | None = None

    def start(self) -> None:
        self._marks = ThreadMarks.now(self.gc_clock)

    def end(self, steps: list[StepStats], commands_s: float, num_commands: int) -> None:
        marks, self._marks = self._marks, None
        if marks is None or (not steps and not num_commands):  # an idle wait's end: no turn
            return
        fields = marks.since(self.gc_clock)
        took, average = fields.pop("took_s"), self.average_s
        self.average_s = took if average is None else average + SMOOTHING * (took - average)
        if average is None or took < max(MIN_SLOW_S, SLOW_RATIO * average):
            return
        if not any(step.num_decode_tokens for step in steps):  # no stream waited on it: a prompt's own time
            return
        self.num_slow += 1
        fields |= {
            "commands_s": round(commands_s, 4),
            "commands": num_commands,
            "forward_s": round(sum(step.forward_s for step in steps), 4),
            "sample_s": round(sum(step.sample_s for step in steps), 4),
            "rows": sum(step.num_requests for step in steps),
            "prefill_tokens": sum(step.num_prefill_tokens for step in steps),
            "decode_tokens": sum(step.num_decode_tokens for step in steps),
        }
        logger.warning(
            "slow engine turn: %.0f ms, usually %.0f ms; every running request waited for it",
            took * 1000,
            average * 1000,
            extra={"fields": fields},
        )
