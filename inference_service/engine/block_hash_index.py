"""Content addresses of full KV blocks, and the index from address to block.

A block's hash is a chain: `sha256(parent hash ‖ the block's token ids)`, the first block's parent
being a salt that names the model and how it computes (model id and revision, dtype, quantization,
block size). Equal hashes then mean equal K/V: the same tokens at the same positions after the same
prefix, through the same weights. sha256 rather than Python's `hash`: a collision would silently
serve another prompt's K/V, so it must be out of reach, even for a caller who picks the tokens.

Partial reuse: a follow-up turn's prompt usually runs on from an earlier request's tokens and then
differs mid-block (its reply re-tokenized, a new question after the partial last block). So the
index also knows each cached block's parent hash and token keys, and keeps a finished request's
partial last block (a "tail": no hash, since it is not full) while nobody holds it. A request may
then adopt an evictable child of its last hit whose first tokens equal its own, if no full cached
block follows it (a tail, or the last full block of its chain): the block leaves the index, and the
request keeps the matching slots' K/V and writes the rest of the block itself. (A tail after an
adopted block is cut off until the same tokens fill that block again.)

Pure Python over block ids, like `KVCacheManager`, which owns the reference counts and consults
this index for hits and eviction.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_SALT_VERSION = b"prefix-cache/v1"
_MAX_CANDIDATES = 64


def cache_salt(*parts: object) -> bytes:
    """The seed of every hash chain: whatever makes the same tokens give different K/V."""
    digest = hashlib.sha256(_SALT_VERSION)
    for part in parts:
        digest.update(b"\0" + repr(part).encode())
    return digest.digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block given its parent's (or the salt, for the first block)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


@dataclass(frozen=True)
class BlockOrigin:
    """Where a cached block sits in its chain and what it holds: the partial-reuse lookup's key."""

    parent: bytes  # the previous block's hash (the salt for a chain's first block)
    keys: tuple[int, ...]  # the block's computed tokens' hash keys (all of them for a full block)


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
        self._origin: dict[int, BlockOrigin] = {}  # indexed blocks that know theirs, and every tail
        # (parent hash, first key) → blocks of that origin, oldest first
        self._children: dict[tuple[bytes, int], dict[int, None]] = {}
        # parent hash → how many full blocks follow it (tails do not count: cut off, one costs < a block)
        self._num_full_children: collections.Counter[bytes] = collections.Counter()
        self._tails: set[int] = set()  # partial blocks of released requests (evictable, unhashed)

    def __len__(self) -> int:
        return len(self._hash_of) + len(self._tails)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._hash_of or block_id in self._tails

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

    def add(self, block_id: int, block_hash: bytes, origin: BlockOrigin | None = None) -> bool:
        """Index a held block whose tokens are all computed (with its origin: a partial-reuse
        candidate too). False (and nothing changes) when another block already holds this content:
        the duplicate simply stays unindexed."""
        if block_hash in self._block_of:
            return False
        if block_id in self._hash_of or block_id in self._tails:
            raise ValueError(f"block {block_id} is already indexed under another hash")
        self._block_of[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        if origin is not None and origin.keys:
            self._add_origin(block_id, origin)
        return True

    def add_tail(self, block_id: int, origin: BlockOrigin) -> None:
        """Keep a released request's partial last block (nobody holds it): evictable at once."""
        if not origin.keys:
            raise ValueError("a tail holds at least one computed token")
        if block_id in self:
            raise ValueError(f"block {block_id} is already indexed")
        self._tails.add(block_id)
        self._add_origin(block_id, origin)
        self.park(block_id)

    def partial_match(self, parent: bytes, keys: Sequence[int]) -> tuple[int, int] | None:
        """The evictable child of `parent` whose first tokens equal the most of `keys`: (block,
        number of equal leading tokens), or None when none shares even the first token. Only a
        chain's last full block or a tail qualifies: a request that adopts a block overwrites its
        later slots, so a block that other full cached blocks follow (a shared system prompt's last
        block, say) stays for the requests that match it whole. Looks at
        the most recently cached `_MAX_CANDIDATES` of them at most (a lookup stays cheap)."""
        best: tuple[int, int] | None = None
        if not keys:
            return None
        for block_id in itertools.islice(reversed(self._children.get((parent, keys[0]), {})), _MAX_CANDIDATES):
            if block_id not in self._evictable:
                continue  # held: a holder may still read every slot of it
            if self._num_full_children[self._hash_of.get(block_id, b"")]:
                continue  # a cached chain goes on through it: adopting it would cut that chain off
            stored = self._origin[block_id].keys
            common = 0
            for mine, theirs in zip(keys, stored, strict=False):
                if mine != theirs:
                    break
                common += 1
            if not _worth_adopting(common, len(stored), len(keys)):
                continue
            if best is None or common > best[1]:
                best = (block_id, common)
        return best

    def adopt(self, block_id: int) -> None:
        """An evictable block leaves the index for a request that keeps part of its K/V and
        writes the rest: it is that request's own block from now on."""
        del self._evictable[block_id]
        self._forget(block_id)

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
        self._forget(block_id)
        return block_id

    def evictable_order(self) -> list[int]:
        """Evictable blocks, next to be evicted first (for tests and debugging)."""
        return list(self._evictable)

    def _add_origin(self, block_id: int, origin: BlockOrigin) -> None:
        self._origin[block_id] = origin
        self._children.setdefault((origin.parent, origin.keys[0]), {})[block_id] = None
        if block_id in self._hash_of:
            self._num_full_children[origin.parent] += 1

    def _forget(self, block_id: int) -> None:
        origin = self._origin.pop(block_id, None)
        if origin is not None:
            siblings = self._children[origin.parent, origin.keys[0]]
            del siblings[block_id]
            if not siblings:
                del self._children[origin.parent, origin.keys[0]]
            if block_id in self._hash_of:
                self._num_full_children[origin.parent] -= 1
                if not self._num_full_children[origin.parent]:
                    del self._num_full_children[origin.parent]
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is not None:
            del self._block_of[block_hash]
        self._tails.discard(block_id)


def _worth_adopting(num_equal: int, num_stored: int, num_wanted: int) -> bool:
    """Adopting takes the block from the index, so a request takes it only when it runs on through
    all its tokens (a conversation going on where it stopped) or shares at least half of the
    block's tokens on both sides: an unrelated prompt that merely starts alike (the same first word, a BOS)
    leaves another conversation's tail for that conversation's next turn."""
    return num_equal > 0 and (num_equal == num_stored or 2 * num_equal >= max(num_stored, num_wanted))
