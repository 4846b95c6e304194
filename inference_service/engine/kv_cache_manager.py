"""Paged KV cache accounting: a fixed pool of blocks and one block table per request.

Pure Python over block ids; it never touches tensors or request objects, so it can be tested
exhaustively. The tensors themselves live in `worker.kv_cache`.
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    """Hands out blocks of `block_size` token slots from a pool of `num_blocks`."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens.

        Returns the whole table, or None (and changes nothing) when the pool is short.
        """
        table = self._tables.get(request_id, [])
        num_missing = self.num_blocks_for(num_tokens) - len(table)
        if num_missing > len(self._free):
            return None
        if num_missing > 0:
            table = table + [self._free.popleft() for _ in range(num_missing)]
            self._tables[request_id] = table
        return list(table)

    def free(self, request_id: str) -> None:
        """Return all of the request's blocks to the pool (a no-op if it holds none)."""
        table = self._tables.pop(request_id, None)
        if table:
            self._free.extend(table)

    def holders(self) -> list[str]:
        return list(self._tables)
