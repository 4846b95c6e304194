"""gc_pauses: after freeze_loaded_objects, full collections no longer walk what was alive then,
still collect garbage made afterwards, and the frozen objects are handed back at exit."""

from __future__ import annotations

import subprocess
import sys

# In a child of its own: a freeze is process-wide. atexit runs its handlers last-registered first, so
# the one registered before the freeze reports what gc_pauses' own handler left.
CHILD = """
import atexit, gc, weakref
from inference_service.engine.gc_pauses import freeze_loaded_objects

atexit.register(lambda: print("frozen at the end:", gc.get_freeze_count()))

class Node:
    pass

loaded = [Node() for _ in range(1000)]
frozen = freeze_loaded_objects()
assert frozen >= len(loaded), frozen
walked = {id(o) for o in gc.get_objects()}
assert not any(id(node) in walked for node in loaded), "a loaded object is still walked"

later = Node(); later.cycle = later; probe = weakref.ref(later)
del later
gc.collect()
assert probe() is None, "garbage made after the freeze was not collected"
assert freeze_loaded_objects() >= frozen  # a second freeze adds to the first
print("ok", frozen)
"""


def test_loaded_objects_are_skipped_later_garbage_collected_and_all_handed_back_at_exit():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("ok"), lines
    assert lines[-1] == "frozen at the end: 0", lines
