"""Keeps Python's full garbage collections short in a process that has loaded a model.

A loaded server process (torch, transformers, a tokenizer, the model's modules) holds ~0.5M objects
that live as long as it does. Every full (oldest-generation) collection walks them all: ~250 ms on
this project's 2-core machine, with the GIL held, so every stream of that process stalls at once.
In the hostile soak those were the slowest innocent runs (all three innocent loops at the same
moments, 5-7x their idle latency). `gc.freeze` after loading moves them into a permanent generation
that collections skip (CPython's own advice for long-lived servers); objects made afterwards are
collected as before. At exit they are handed back (`gc.unfreeze`), so the interpreter's teardown
frees them as it would have: extension modules that count their live objects at exit (triton's
nanobind bindings) would otherwise report them as leaked on stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_loaded_objects() -> int:
    """Collect once, then leave every object alive now out of later collections; how many that is."""
    gc.collect()
    if not gc.get_freeze_count():
        atexit.register(gc.unfreeze)
    gc.freeze()
    return gc.get_freeze_count()


# A collection this long is said in the log: it held every thread of its process (the GIL) as long.
LONG_COLLECTION_S = 0.05


class GcClock:
    """Times this process's garbage collections (gc.callbacks): their total so far, for a caller
    that wants to know what part of a slow stretch they were, and each one over LONG_COLLECTION_S
    said in the log (what a stall of every stream at once would otherwise leave unexplained)."""

    def __init__(self, long_s: float = LONG_COLLECTION_S):
        self.long_s = long_s
        self.total_s = 0.0
        self.num_long = 0
        self._started = 0.0
        gc.callbacks.append(self._callback)
        atexit.register(self.close)  # the collections at exit are no stall, and logging may be closed by then

    def close(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        took = now - self._started
        self.total_s += took
        if took >= self.long_s:
            self.num_long += 1
            logger.warning(
                "long garbage collection: %.0f ms (generation %d, %d collected)",
                took * 1000,
                info["generation"],
                info["collected"],
                extra={"fields": {"gc_s": round(took, 4), "generation": info["generation"]}},
            )
