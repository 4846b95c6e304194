"""Paged KV cache accounting: a fixed pool of blocks, one block table per request, and (with prefix
caching) blocks shared between requests by reference count.

Pure Python over block ids; it never touches tensors or request objects, so it can be tested
exhaustively. The tensors themselves live in `worker.attention.kv_cache`.

Every block is in exactly one of three states:
- held: in the tables of `ref_count(block) > 0` requests. Only full, computed blocks found through
  the hash index are ever held by more than one; a request writes only into blocks it got fresh;
- free: held by none, holding nothing worth keeping;
- evictable (prefix caching only): held by none, but indexed: its K/V can still be reused by a
  hit, until the pool needs a block and it is evicted, least recently released first. A released
  request's partial last block can be kept so too (`keep_tail`), and an evictable block can be
  adopted by a request that reuses its first slots and writes the rest (`allocate_slots`).
Free and evictable blocks both count as free (`num_free_blocks`): either can be handed out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from inference_service.engine.block_hash_index import BlockHashIndex, BlockOrigin


class KVCacheManager:
    """Hands out blocks of `block_size` token slots from a pool of `num_blocks`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._num_indexed: dict[str, int] = {}  # leading blocks of a request's table that are indexed
        self._tails: dict[str, tuple[int, BlockOrigin]] = {}  # request → (table position, origin) kept at free
        self.index: BlockHashIndex | None = BlockHashIndex() if enable_prefix_caching else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (free or evictable): what allocation can still hand out."""
        return len(self._free) + (self.index.num_evictable if self.index is not None else 0)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose K/V a hit can reuse (held or evictable)."""
        return len(self.index) if self.index is not None else 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest indexed run of `block_hashes` (nothing without prefix caching)."""
        return self.index.longest_prefix(block_hashes) if self.index is not None else []

    def partial_match(self, parent: bytes, keys: Sequence[int]) -> tuple[int, int] | None:
        """An evictable block after `parent` whose first tokens are `keys`' first: (block, how many)."""
        return self.index.partial_match(parent, keys) if self.index is not None else None

    def allocate_slots(
        self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = (), adopted: int | None = None
    ) -> list[int] | None:
        """Grow the request's table to hold `num_tokens` tokens.

        `cached_blocks` (from `cached_prefix`, for a request that holds nothing yet) start the
        table and are shared, not copied; `adopted` (from `partial_match`) follows them, taken out
        of the index: the request's own from now on; the rest are fresh blocks the request alone
        writes. Returns the whole table, or None (and changes nothing) when the pool is short.
        """
        table = self._tables.get(request_id, [])
        head = [*cached_blocks, adopted] if adopted is not None else list(cached_blocks)
        if head and table:
            raise ValueError(f"request {request_id!r} already holds blocks: a prefix hit must start its table")
        if adopted is not None and (self.index is None or not self.index.is_evictable(adopted)):
            raise ValueError(f"block {adopted} is not an evictable cached block: it cannot be adopted")
        num_missing = self.num_blocks_for(num_tokens) - len(table) - len(head)
        if num_missing < 0 and head:
            raise ValueError("the cached prefix is longer than the tokens to hold")
        # Evictable hits are about to be held: they are no longer there to be handed out fresh.
        num_reclaimed = sum(1 for block in head if self._ref_counts[block] == 0)
        if num_missing > self.num_free_blocks - num_reclaimed:
            return None
        if num_missing <= 0 and not head:
            return list(table)
        for block in cached_blocks:
            self._hold(block)
        if adopted is not None and self.index is not None:
            self.index.adopt(adopted)
            self._ref_counts[adopted] = 1
        table = table + head + [self._take_fresh() for _ in range(max(num_missing, 0))]
        self._tables[request_id] = table
        if cached_blocks:
            self._num_indexed[request_id] = len(cached_blocks)
        return list(table)

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_blocks: int,
        origin_of: Callable[[int], BlockOrigin] | None = None,
    ) -> None:
        """Index the request's first `num_blocks` blocks, full and computed, under `block_hashes`
        (and `origin_of(position)`, for partial reuse).

        Only now can other requests share them: a block still being written is never indexed.
        """
        if self.index is None:
            return
        start = self._num_indexed.get(request_id, 0)
        if num_blocks <= start:
            return
        table = self._tables[request_id]
        for position in range(start, num_blocks):
            self.index.add(table[position], block_hashes[position], origin_of(position) if origin_of else None)
        self._num_indexed[request_id] = num_blocks

    def keep_tail(self, request_id: str, position: int, origin: BlockOrigin) -> None:
        """When the request frees its blocks, keep the one at `position` (partly computed: what
        `origin.keys` names) for partial reuse instead of freeing it."""
        if self.index is not None and position < len(self._tables.get(request_id, ())) and origin.keys:
            self._tails[request_id] = (position, origin)

    def free(self, request_id: str) -> None:
        """Let go of all of the request's blocks (a no-op if it holds none).

        Released last block first, so that a chain's tail is evicted before its head: a lost head
        makes the rest of the chain unreachable anyway.
        """
        table = self._tables.pop(request_id, None) or []
        self._num_indexed.pop(request_id, None)
        tail = self._tails.pop(request_id, None)
        for position in range(len(table) - 1, -1, -1):
            block = table[position]
            self._ref_counts[block] -= 1
            if self._ref_counts[block] > 0:
                continue
            if self.index is not None and block in self.index:
                self.index.park(block)
            elif self.index is not None and tail is not None and position == tail[0]:
                self.index.add_tail(block, tail[1])
            else:
                self._free.append(block)

    def holders(self) -> list[str]:
        return list(self._tables)

    # -- blocks ---------------------------------------------------------------------------
    def _hold(self, block: int) -> None:
        if self._ref_counts[block] == 0 and self.index is not None:
            self.index.unpark(block)
        self._ref_counts[block] += 1

    def _take_fresh(self) -> int:
        """A block for new K/V: a free one, else the least recently released cached one."""
        if not self._free and self.index is None:
            raise RuntimeError("no free KV block")  # callers check num_free_blocks first
        block = self._free.popleft() if self._free or self.index is None else self.index.evict()
        self._ref_counts[block] = 1
        return block
