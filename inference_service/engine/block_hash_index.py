"""Content addresses of full KV blocks, and the index from address to block.

A block's hash is a chain: `sha256(parent hash ‖ the block's token ids)`, the first block's parent
being a salt that names the model and how it computes (model id and revision, dtype, quantization,
block size). Equal hashes then mean equal K/V: the same tokens at the same positions after the same
prefix, through the same weights. sha256 rather than Python's `hash`: a collision would silently
serve another prompt's K/V, so it must be out of reach, even for a caller who picks the tokens.

Pure Python over block ids, like `KVCacheManager`, which owns the reference counts and consults
this index for hits and eviction.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_SALT_VERSION = b"prefix-cache/v1"


def cache_salt(*parts: object) -> bytes:
    """The seed of every hash chain: whatever makes the same tokens give different K/V."""
    digest = hashlib.sha256(_SALT_VERSION)
    for part in parts:
        digest.update(b"\0" + repr(part).encode())
    return digest.digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block given its parent's (or the salt, for the first block)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockHashIndex:
    """hash ⇄ block for full blocks whose K/V are all computed; the ones no request holds (the
    evictable ones) in least-recently-released order.

    A block the index knows is in one of two states: held by requests (the manager counts them),
    or evictable: its K/V still valid and reusable by a hit, until the pool needs the block.
    """

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = released longest ago

    def __len__(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._hash_of

    def hash_of(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def longest_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest run of `block_hashes`, from the first, that the index holds."""
        blocks = []
        for block_hash in block_hashes:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def add(self, block_id: int, block_hash: bytes) -> bool:
        """Index a held block whose tokens are all computed. False (and nothing changes) when
        another block already holds this content: the duplicate simply stays unindexed."""
        if block_hash in self._block_of:
            return False
        if block_id in self._hash_of:
            raise ValueError(f"block {block_id} is already indexed under another hash")
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def park(self, block_id: int) -> None:
        """The last request holding an indexed block let go: it becomes the most recently used."""
        self._evictable[block_id] = None
        self._evictable.move_to_end(block_id)

    def unpark(self, block_id: int) -> None:
        """A hit takes an evictable block back."""
        del self._evictable[block_id]

    def evict(self) -> int:
        """Forget the least recently released block and return it, free for new K/V."""
        block_id, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block_id)]
        return block_id

    def evictable_order(self) -> list[int]:
        """Evictable blocks, next to be evicted first (for tests and debugging)."""
        return list(self._evictable)
