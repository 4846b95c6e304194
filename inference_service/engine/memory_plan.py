"""KV cache blocks from the memory a CUDA device has left (`--cuda-memory-fraction`), TGI's rule,
as pure arithmetic so it is tested without a GPU.

TGI loads the weights, runs one profiling forward pass over a full prefill batch (so the
activations' peak is held by torch's caching allocator), then gives the KV cache what the device
still has free, less the share of its total memory the fraction keeps out, times a wiggle room of
0.9 (TGI_WIGGLE_ROOM) for what the profile could not see.
"""

from __future__ import annotations

WIGGLE_ROOM = 0.9


def usable_free_memory(free_bytes: int, total_bytes: int, fraction: float) -> int:
    """Free bytes the server may still take: what is free, less the (1 - fraction) of the device
    that is not ours (TGI's get_free_memory)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"the memory fraction must be in (0, 1], not {fraction}")
    return max(0, int(free_bytes - (1.0 - fraction) * total_bytes))


def kv_blocks_from_memory(
    free_bytes: int, total_bytes: int, fraction: float, bytes_per_block: int, wiggle_room: float = WIGGLE_ROOM
) -> int:
    """KV blocks that fit in the memory left after the profiling forward pass."""
    if bytes_per_block < 1:
        raise ValueError(f"a block takes at least one byte, not {bytes_per_block}")
    return int(usable_free_memory(free_bytes, total_bytes, fraction) * wiggle_room) // bytes_per_block
