"""Prefix caching, as the scheduler sees it: what an admitted request can reuse, when it is worth
waiting a step for, and which blocks become reusable once a step has computed them.

A request counts `num_computed_tokens` anyway, so a hit only starts that counter higher: the
scheduler admits the request with the cached blocks at the head of its block table, and the
runner computes the rest like any chunked-prefill continuation. Exactness rules:
- the last known token is always computed (its logits pick the next token), so at most the full
  blocks before it are reused; a request writes only into blocks it got fresh;
- a request that wants logprobs of its prompt (`decoder_input_details`) needs logits at every
  prompt position: it reuses nothing (TGI does the same);
- blocks are indexed only once every token in them is computed (after the step), never while a
  request is still writing them.

Partial blocks: after its full-block hit, a request may go on into a cached block that it shares
only the first tokens of (a follow-up turn: the first turn's reply, re-tokenized, differs from the
generated ids somewhere inside a block; or the follow-up runs through the first turn's partial last
block, kept when it finished). That block must be evictable (nobody reads it any more): the request
adopts it (`KVCacheManager.allocate_slots`), reuses the equal slots' K/V and computes the rest, as
SGLang's token-granular radix cache would. Its origin leaves the index; the request indexes it anew
once it is full. The same rules hold: the last known token is computed, and a hit never ends inside
a both-way span.

In-flight prefixes: when a running request is computing the very blocks a waiting request would
reuse (`best_of`/`n` variants, or many conversations with one system prompt arriving together),
the waiting request is passed over until they are computed, then reuses them: the prompt is
computed once, not once per request. It never waits on a request that is not running, so it
waits a few steps at most; requests behind it in the queue are not held up by it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from inference_service.engine.block_hash_index import BlockOrigin, hash_block
from inference_service.engine.kv_cache_manager import KVCacheManager
from inference_service.engine.request import Request


@dataclass
class PrefixHit:
    """What a waiting request can reuse now."""

    block_ids: list[int] = field(default_factory=list)  # cached blocks, in table order
    num_tokens: int = 0  # tokens whose K/V they hold: len(block_ids) * block_size (+ adopted's share)
    wait: bool = False  # a running request is computing the next block right now: admit it later
    adopted_block: int | None = None  # an evictable block after them whose first slots it reuses


class PrefixCache:
    """Prefix lookups, in-flight claims and hit statistics over a `KVCacheManager`'s hash index."""

    def __init__(self, kv: KVCacheManager, salt: bytes, adapter_salt: Callable[[str], bytes] | None = None):
        self.kv = kv
        self.salt = salt
        # A LoRA adapter's chains start from their own seed: its K/V differ from the base's for the
        # same tokens, and from every other adapter's.
        self.adapter_salt = adapter_salt
        self.block_size = kv.block_size
        # hash of a full block a running request will compute → that request
        self._claims: dict[bytes, str] = {}
        self._claims_of: dict[str, deque[tuple[int, bytes]]] = {}  # request → (block index, hash)
        self.num_queried_tokens = 0  # tokens to compute at admissions
        self.num_hit_tokens = 0  # of those, reused from the cache
        self.num_adopted_blocks = 0  # hits that went on into part of a cached block

    @property
    def enabled(self) -> bool:
        return self.kv.index is not None

    def lookup(self, request: Request) -> PrefixHit:
        """The longest cached prefix a waiting request may reuse (it holds no block yet)."""
        if not self.enabled or _needs_every_prompt_logit(request):
            return PrefixHit()
        max_tokens = request.num_tokens - 1  # the last token is always computed
        max_blocks = max_tokens // self.block_size
        hashes = self._block_hashes(request, max_blocks)
        blocks = self.kv.cached_prefix(hashes[:max_blocks])
        wait = len(blocks) < max_blocks and hashes[len(blocks)] in self._claims
        start = len(blocks) * self.block_size
        if wait or start >= max_tokens:
            return PrefixHit(blocks, start, wait)
        parent = hashes[len(blocks) - 1] if blocks else self._salt_of(request)
        keys = request.block_key(start, min(start + self.block_size, max_tokens))
        match = self.kv.partial_match(parent, keys)
        if match is None:
            return PrefixHit(blocks, start)
        adopted, num_equal = match
        end = _outside_spans(request, start, start + num_equal)
        if end <= start:
            return PrefixHit(blocks, start)
        return PrefixHit(blocks, end, adopted_block=adopted)

    def admitted(self, request: Request, hit: PrefixHit) -> None:
        """Count the hit, and claim the full blocks of known tokens this request will compute."""
        if not self.enabled:
            return
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += hit.num_tokens
        self.num_adopted_blocks += hit.adopted_block is not None
        if _needs_every_prompt_logit(request):
            return  # it still computes (and indexes) them, but claims would stall others needlessly
        num_full = request.num_tokens // self.block_size
        hashes = self._block_hashes(request, num_full)
        claims: deque = deque()
        for position in range(len(hit.block_ids), num_full):
            if hashes[position] not in self._claims:
                self._claims[hashes[position]] = request.request_id
                claims.append((position, hashes[position]))
        if claims:
            self._claims_of[request.request_id] = claims

    def computed(self, request: Request) -> None:
        """After a step: make the request's full, computed blocks reusable; drop their claims."""
        if not self.enabled:
            return
        num_full = request.num_computed_tokens // self.block_size
        hashes = self._block_hashes(request, num_full)
        self.kv.cache_blocks(request.request_id, hashes, num_full, lambda position: self._origin(request, position))
        claims = self._claims_of.get(request.request_id)
        while claims and claims[0][0] < num_full:
            self._drop_claim(request.request_id, claims.popleft()[1])
        if claims is not None and not claims:
            del self._claims_of[request.request_id]

    def released(self, request: Request) -> None:
        """The request is letting go of its blocks (finished, aborted, preempted): it computes
        nothing more. Its partial last block stays cached (evictable) for partial reuse."""
        for _, block_hash in self._claims_of.pop(request.request_id, ()):
            self._drop_claim(request.request_id, block_hash)
        if self.enabled and request.num_computed_tokens % self.block_size:
            position = request.num_computed_tokens // self.block_size
            try:
                self._block_hashes(request, position)
                origin = self._origin(request, position, request.num_computed_tokens)
            except ValueError:  # its adapter is gone: nothing left to key the block by, so it is freed
                return
            self.kv.keep_tail(request.request_id, position, origin)

    @property
    def num_claims(self) -> int:
        return len(self._claims)

    def _drop_claim(self, request_id: str, block_hash: bytes) -> None:
        if self._claims.get(block_hash) == request_id:
            del self._claims[block_hash]

    def _block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's hash chain, at least `num_blocks` long (memoized on the request: its tokens
        never change, only grow). Returned as is, not copied: may be longer than asked."""
        hashes = request.block_hashes
        size = self.block_size
        parent = hashes[-1] if hashes else self._salt_of(request)
        for position in range(len(hashes), num_blocks):
            parent = hash_block(parent, request.block_key(position * size, (position + 1) * size))
            hashes.append(parent)
        return hashes

    def _origin(self, request: Request, position: int, end: int | None = None) -> BlockOrigin:
        """Block `position`'s parent and keys (its tokens up to `end`; default: the whole block)."""
        start = position * self.block_size
        parent = request.block_hashes[position - 1] if position else self._salt_of(request)
        return BlockOrigin(parent, tuple(request.block_key(start, end or start + self.block_size)))

    def _salt_of(self, request: Request) -> bytes:
        if request.adapter_id is None:
            return self.salt
        if self.adapter_salt is None:
            raise ValueError(f"request {request.request_id} names a LoRA adapter, and none are served")
        return self.adapter_salt(request.adapter_id)


def _outside_spans(request: Request, start: int, end: int) -> int:
    """`end`, or the start of the both-way span it would fall inside (never before `start`)."""
    for span_start, span_end in request.both_way_spans:
        if span_start < end < span_end:
            return max(span_start, start)
    return end


def _needs_every_prompt_logit(request: Request) -> bool:
    return request.sampling.prompt_logprobs and not request.prompt_logprobs_done
