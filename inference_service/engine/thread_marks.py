"""Where a stretch of one thread's time went: on a CPU, preempted, asleep, or in garbage collection.

A stretch that took long while its thread was mostly off the CPU did not wait for its own work: with
many `preempted` (the kernel ran something else) it waited for the machine's cores, with many
`waited` (it slept) for the GIL, a lock or the model's worker threads; `gc_s` is the process's
garbage collections meanwhile (they hold the GIL: every thread of the process waits for them).
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass

from inference_service.engine.gc_pauses import GcClock


@dataclass(frozen=True)
class ThreadMarks:
    """The calling thread's clocks at one moment (`now`); `since` gives what passed after it."""

    wall_s: float
    cpu_s: float
    gc_s: float
    involuntary: int
    voluntary: int

    @classmethod
    def now(cls, gc_clock: GcClock) -> ThreadMarks:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return cls(time.perf_counter(), time.thread_time(), gc_clock.total_s, usage.ru_nivcsw, usage.ru_nvcsw)

    def since(self, gc_clock: GcClock) -> dict[str, float]:
        """On the calling thread, the one `now` was read on: the stretch's wall time and where it went."""
        later = ThreadMarks.now(gc_clock)
        return {
            "took_s": round(later.wall_s - self.wall_s, 4),
            "on_cpu_s": round(later.cpu_s - self.cpu_s, 4),
            "preempted": later.involuntary - self.involuntary,
            "waited": later.voluntary - self.voluntary,
            "gc_s": round(later.gc_s - self.gc_s, 4),
        }
