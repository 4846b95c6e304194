"""gc_pauses: after freeze_loaded_objects, full collections no longer walk what was alive then,
and still collect garbage made afterwards."""

from __future__ import annotations

import subprocess
import sys

# In a child of its own: a freeze is process-wide.
CHILD = """
import gc, weakref
from inference_service.engine.gc_pauses import freeze_loaded_objects

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
print("ok", frozen)
"""


def test_loaded_objects_are_skipped_and_later_garbage_is_collected():
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")
