"""Keeps the memory a CPU step frees in the process heap, for the next step to reuse.

A prefill step allocates tens of MB of activations per layer (the demo model's 2,048-token step:
about 60 MB a layer, in blocks of 4-25 MB). glibc serves a block over its mmap threshold (128 KiB,
raised by the frees of big blocks, at most 32 MiB) with a fresh mmap and unmaps it on free, and
trims the heap's top when more than its trim threshold lies free: the next step's blocks are new
pages, each faulted in and zeroed by the kernel. Measured on the demo model (16 prompts of 128
tokens, fp32, 1 thread): ~800k minor faults per two such steps and ~20% of their CPU time; with
both thresholds raised, ~14k faults.

The heap then keeps what the largest step used (its peak is the same), which is what a server
wants: the next large step needs it again. Other C libraries (no `mallopt`, or one that refuses
these values) are left as they are.

`cap_arenas` bounds the other way a server's heap grows: glibc gives threads heaps of their own
(up to 8 per core), and short-lived threads that allocate a lot (grammar compiles, one a request)
leave each of those heaps fragmented. Under the hostile soak's grammars the API process's RSS
rose ~40-90 MiB over 3,000 cases with the default and stayed flat (+13 MiB) with two arenas.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

# mallopt's parameter numbers (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
# Heaps threads share: the main one and one more (the engine thread and the server's threads
# allocate little besides tensors, which are large blocks either way).
MAX_ARENAS = 2
# Blocks up to this size come from the heap: a 2,048-token step of a ~1.5B model allocates 150 MB
# blocks (its MLP's gate and up rows). Older glibc versions cap the threshold at 32 MiB.
MMAP_THRESHOLD = 1 << 30
FALLBACK_MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top kept up to this much (a large step's activations).
TRIM_THRESHOLD = 1 << 30

_done = False


def _mallopt():
    """The C library's `mallopt`, or None where there is none (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def cap_arenas(max_arenas: int = MAX_ARENAS) -> bool:
    """Let threads created from now on share `max_arenas` heaps; True where the C library took it.
    Called first thing in the API process and the engine core, before their threads start."""
    mallopt = _mallopt()
    return bool(mallopt and mallopt(M_ARENA_MAX, max_arenas))


def keep_freed_memory() -> bool:
    """Raise the C library's mmap and trim thresholds once per process; True where it took them."""
    global _done
    if _done:
        return True
    mallopt = _mallopt()
    if mallopt is None:
        return False
    if not mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and not mallopt(M_MMAP_THRESHOLD, FALLBACK_MMAP_THRESHOLD):
        return False
    _done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if _done:
        logger.debug("freed step memory stays in the heap (mmap and trim thresholds raised)")
    return _done
