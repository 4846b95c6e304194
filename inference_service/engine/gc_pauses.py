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
import gc


def freeze_loaded_objects() -> int:
    """Collect once, then leave every object alive now out of later collections; how many that is."""
    gc.collect()
    if not gc.get_freeze_count():
        atexit.register(gc.unfreeze)
    gc.freeze()
    return gc.get_freeze_count()
