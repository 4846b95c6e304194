"""A lone prefill step gives way to a request that arrives during it.

A step of long prompts' chunks alone (nobody decodes in it, no prompt is run whole in it: a lone
long prompt, or several) runs the whole budget, ~0.7 s on a 2-core CPU. A request arriving meanwhile
waited for all of it before its own step could start: its first token came ~4.6× later than on an
idle engine. Smaller lone steps would pay the step's fixed cost many times over a long prompt.

So such a step runs interruptible: a front that queues a request or an abort for the engine loop
counts it in `Arrivals` until the loop takes it, the paged attention function asks between decoder
layers (`worker.step_yield`), and the step stops there. Nothing of it is kept: the scheduler's
counters move only in `update`, which a yielded step never reaches, so its chunks run again from
where they were, in a step planned with the arrival (held to the stream pool like any step that
carries a stream); the K/V it wrote is written again, and its blocks stay with their requests.

The waste is bounded: a step with less than `LEFT_TO_FINISH` of the clock's fixed step time left
(estimated from its layers so far) finishes instead. A yield for an arrival that changed the plan
(a request admitted beside the long prompt, the long prompt aborted) costs the long prompt at most
the part of one step it threw away, once per arrival. A yield after which the same requests run
again changed nothing (a request refused at once, the abort of one that was not running): the time
such yields throw away is at most `WASTE_SHARE` of the time of the interruptible steps that ran to
their end (plus one step), so a flood of them cannot starve the long prompt.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from inference_service.outputs import ScheduledRequest
from inference_service.worker.step_yield import StepYielded, yielding

# A step this close to its end (in the clock's fixed step times) finishes rather than give way.
LEFT_TO_FINISH = 0.25
# Time thrown away by yields: at most this share of the interruptible steps' time run to the end.
WASTE_SHARE = 0.2


class Arrivals:
    """Commands that may change the next step's plan (a new request, an abort), counted from just
    before a front queues one until the engine loop takes it off the queue: a step yields only while
    one is really waiting (counting them, rather than a flag the loop clears, leaves no race)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending = 0

    def coming(self) -> None:
        with self._lock:
            self._pending += 1

    def taken(self) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def waiting(self) -> bool:
        return self._pending > 0


class StepYield:
    """Decides, per step and per layer, whether a step gives way; counts what that cost."""

    def __init__(self) -> None:
        self.arrivals = Arrivals()
        self.enabled = True  # False: every step runs whole (benchmarks compare the two)
        self.num_yields = 0
        self.wasted_s = 0.0  # time of the yielded steps, thrown away
        # What yields that changed nothing may still throw away (WASTE_SHARE of the full steps' time;
        # it may dip below 0, and then no step yields until full steps have made up for it).
        self._credit_s = 0.0
        self._started = 0.0
        self._finish_within_s = 0.0
        self._last_yield: tuple[frozenset[str], float] | None = None  # its requests, the time it threw away

    @contextlib.contextmanager
    def running(self, scheduled: list[ScheduledRequest], fixed_s: float | None) -> Iterator[None]:
        """Run the step's forward pass in this context: it raises `StepYielded` if the step gave way.
        `fixed_s`: a step's fixed time as the clock learned it (None: not learned)."""
        request_ids = frozenset(item.request_id for item in scheduled)
        if self._last_yield is not None:
            yielded_ids, thrown_away_s = self._last_yield
            if request_ids == yielded_ids:  # the same requests again: that yield changed nothing
                self._credit_s -= thrown_away_s
            self._last_yield = None
        if not self.enabled or not all(_long_prompt_chunk(item) for item in scheduled):
            yield  # a stream's token, or a short prompt's first, comes from this step: it runs whole
            return
        self._started = time.perf_counter()
        if self._credit_s < 0:
            yield  # too much thrown away for nothing lately: it runs whole, and makes up for that
        else:
            self._finish_within_s = LEFT_TO_FINISH * (fixed_s or 0.0)
            try:
                with yielding(self._check):
                    yield
            except StepYielded:
                spent = time.perf_counter() - self._started
                self.num_yields += 1
                self.wasted_s += spent
                self._last_yield = (request_ids, spent)
                raise
        spent = time.perf_counter() - self._started
        self._credit_s = min(self._credit_s + WASTE_SHARE * spent, spent)  # at most one step banked

    def _check(self, done: float) -> bool:
        if not self.arrivals.waiting:
            return False
        if done <= 0:
            return True
        left = (time.perf_counter() - self._started) * (1 - done) / done
        return left > self._finish_within_s


def _long_prompt_chunk(item: ScheduledRequest) -> bool:
    """A chunk of a prompt prefilled over several steps: one that leaves part of it for later, or its
    last (which would give the prompt's first token: given way, it comes a little later, and that
    prompt's first token was a long wait anyway). Not a decode, nor a prompt run whole."""
    return not item.sample or (item.num_computed_tokens > 0 and item.num_known_tokens > 1)
