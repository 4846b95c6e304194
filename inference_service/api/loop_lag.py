"""Says in the log when the API process's event loop came late: every call of the process (gRPC
streams, REST through the gateway) waited as long.

A task asks to wake every TICK_S and logs a wake later than LATE_S, with where the loop thread's time
went meanwhile (engine/thread_marks.py): mostly on the CPU, a callback held the loop (work that belongs
off it); mostly off it, the loop waited for the machine or the GIL; `gc_s`, a garbage collection.
"""

from __future__ import annotations

import asyncio
import logging

from inference_service.engine.gc_pauses import GcClock
from inference_service.engine.thread_marks import ThreadMarks

logger = logging.getLogger(__name__)

TICK_S = 0.02
LATE_S = 0.05


async def watch_loop_lag(gc_clock: GcClock, tick_s: float = TICK_S, late_s: float = LATE_S) -> None:
    """Until cancelled: log each wake at least `late_s` late."""
    while True:
        marks = ThreadMarks.now(gc_clock)
        await asyncio.sleep(tick_s)
        fields = marks.since(gc_clock)
        late = fields["took_s"] - tick_s
        if late >= late_s:
            fields["late_s"] = round(late, 4)
            logger.warning(
                "event loop late: %.0f ms; every call of this process waited", late * 1000, extra={"fields": fields}
            )
