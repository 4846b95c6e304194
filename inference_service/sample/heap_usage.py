"""How many bytes the process's C heap holds in use (glibc's `mallinfo2`): what a native library's
allocations cost, where Python's own accounting sees nothing of them (grammar.py charges its cache
of compiled grammars by it)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


@functools.cache
def _mallinfo2() -> Callable[[], _MallInfo2] | None:
    try:
        function = ctypes.CDLL(None).mallinfo2  # glibc ≥ 2.33
    except (AttributeError, OSError):
        return None
    function.argtypes, function.restype = [], _MallInfo2
    return function


def heap_in_use() -> int | None:
    """Bytes allocated and not freed: small chunks in the arenas and large ones mapped on their own;
    None where the C library does not say (not glibc)."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)
