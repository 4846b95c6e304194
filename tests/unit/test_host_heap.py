"""host_heap: after keep_freed_memory, a step's large activations reuse freed pages instead of
faulting fresh ones in (glibc only: elsewhere it must say it did nothing)."""

from __future__ import annotations

import ctypes
import platform
import resource

import pytest
import torch

from inference_service.engine import host_heap

GLIBC = platform.libc_ver()[0] == "glibc"


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def faults_per_round(num_bytes: int, rounds: int) -> list[int]:
    """Minor faults of each round of allocating, writing and freeing `num_bytes` in blocks of 8 MiB-40 MiB."""
    counts = []
    for _ in range(rounds):
        before = minor_faults()
        blocks = [torch.empty(size // 4).fill_(1.0) for size in (8 << 20, 40 << 20, num_bytes - (48 << 20))]
        del blocks
        counts.append(minor_faults() - before)
    return counts


@pytest.mark.skipif(not GLIBC, reason="mallopt's thresholds are glibc's")
def test_freed_blocks_are_reused_not_faulted_in_again():
    assert host_heap.keep_freed_memory()
    assert host_heap.keep_freed_memory()  # once per process; a second call is a no-op that says so
    num_bytes = 96 << 20
    pages = num_bytes // resource.getpagesize()
    counts = faults_per_round(num_bytes, rounds=12)
    # Without it every round faults in about every page (a fresh mmap per block); with it the
    # heap grows to the rounds' size once and later rounds touch only pages they already have. The
    # count is the process's, and the heap can take a few rounds to settle under load (4 here):
    # one of the last rounds may still fault, not three.
    assert sum(count < pages // 20 for count in counts[-4:]) >= 3, counts


def test_no_mallopt_leaves_the_c_library_alone(monkeypatch):
    class NoMallopt:
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(host_heap, "_done", False)
    monkeypatch.setattr(ctypes, "CDLL", lambda name: NoMallopt())
    assert host_heap.keep_freed_memory() is False


@pytest.mark.skipif(not GLIBC, reason="M_ARENA_MAX is glibc's")
def test_threads_share_the_capped_arenas():
    import subprocess
    import sys

    # In a child of its own: the cap is process-wide. Eight threads that each allocate and hold a block
    # would get a heap each; capped, malloc_stats lists the main arena and one more.
    code = """
import ctypes, threading
from inference_service.engine import host_heap
assert host_heap.cap_arenas()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
start, done = threading.Barrier(9), threading.Barrier(9)
def hold():
    start.wait(); libc.malloc(1 << 16); done.wait()
threads = [threading.Thread(target=hold) for _ in range(8)]
[t.start() for t in threads]
start.wait(); done.wait()
[t.join() for t in threads]
libc.malloc_stats()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    arenas = result.stderr.count("Arena ")
    assert 1 <= arenas <= host_heap.MAX_ARENAS, result.stderr
