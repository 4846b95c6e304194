"""Prefix caching without a model: the block hash index, shared blocks' reference counts, LRU
eviction, and the scheduler under random request streams with shared prefixes, preemption and
cancellation, checked against a shadow of what each KV slot must hold."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference_service.engine.block_hash_index import BlockHashIndex, BlockOrigin, cache_salt, hash_block
from inference_service.engine.kv_cache_manager import KVCacheManager
from inference_service.engine.prefix_cache import PrefixCache, PrefixHit
from inference_service.engine.request import Request, RequestStatus
from inference_service.engine.scheduler import Scheduler
from inference_service.sampling_params import ImageInput, SamplingParams, StoppingParams

SALT = cache_salt("test-model")


def _chain(tokens: list[int], block_size: int, salt: bytes = SALT) -> list[bytes]:
    hashes, parent = [], salt
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


def _request(request_id: str, tokens: list[int], max_new: int = 4, prompt_logprobs: bool = False) -> Request:
    return Request(request_id, list(tokens), SamplingParams(prompt_logprobs=prompt_logprobs), StoppingParams(max_new))


# -- hashing --------------------------------------------------------------------------------------
def test_hash_chain_depends_on_the_whole_prefix_and_the_salt():
    a = _chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = _chain([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[1] != b[1]  # same second block, different first: different chain
    assert _chain([1, 2, 3, 4], 4, cache_salt("other-model")) != a[:1]
    assert _chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == a  # only full blocks are hashed
    assert hash_block(SALT, [1, 2]) != hash_block(SALT, [2, 1])
    assert hash_block(SALT, [256]) != hash_block(SALT, [1, 0])  # token ids are not byte-joined


def test_salt_names_every_part():
    assert cache_salt("m", "sha", "float32") != cache_salt("m", "sha", "bfloat16")
    assert cache_salt("m", None) != cache_salt("m", "None ")


# -- the manager with shared blocks -------------------------------------------------------------
def _fill(kv: KVCacheManager, request_id: str, tokens: list[int]) -> list[int]:
    """Allocate for `tokens`, reusing what is cached, and index the full blocks as if computed."""
    hashes = _chain(tokens, kv.block_size)
    cached = kv.cached_prefix(hashes[: (len(tokens) - 1) // kv.block_size])
    table = kv.allocate_slots(request_id, len(tokens), cached)
    assert table is not None
    kv.cache_blocks(request_id, hashes, len(tokens) // kv.block_size)
    return table


def test_a_hit_shares_blocks_and_counts_references():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = _fill(kv, "a", list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    second = _fill(kv, "b", list(range(8)) + [50, 51, 52])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert [kv.ref_count(b) for b in first] == [2, 2, 1]
    kv.free("a")
    assert [kv.ref_count(b) for b in first] == [1, 1, 0]
    assert kv.num_free_blocks == 8 - 3
    kv.free("b")
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 2  # the shared blocks stay cached


def test_the_last_token_is_never_taken_from_the_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prefix = PrefixCache(kv, SALT)
    _fill(kv, "a", list(range(8)))
    kv.free("a")
    hit = prefix.lookup(_request("b", list(range(8))))  # all 8 cached, but token 8's logits are needed
    assert hit.num_tokens == 4 and len(hit.block_ids) == 1
    assert prefix.lookup(_request("c", list(range(9)))).num_tokens == 8


def test_requests_wanting_prompt_logprobs_reuse_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prefix = PrefixCache(kv, SALT)
    _fill(kv, "a", list(range(12)))
    assert prefix.lookup(_request("b", list(range(12)), prompt_logprobs=True)).num_tokens == 0
    assert prefix.lookup(_request("c", list(range(12)))).num_tokens == 8


def test_without_prefix_caching_nothing_is_indexed():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    table = _fill(kv, "a", list(range(8)))
    kv.free("a")
    assert kv.num_cached_blocks == 0 and kv.cached_prefix(_chain(list(range(8)), 4)) == []
    assert PrefixCache(kv, SALT).lookup(_request("b", list(range(9)))).num_tokens == 0
    assert sorted(table) == [0, 1]


def test_eviction_takes_the_least_recently_released_block_and_tails_first():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = _fill(kv, "a", [1, 2, 3, 4, 5])  # 2 full blocks + 1 partial
    b = _fill(kv, "b", [7, 8, 9])  # 1 full + 1 partial
    kv.free("a")  # partial goes back free; a's tail is parked before its head
    kv.free("b")
    assert kv.index.evictable_order() == [a[1], a[0], b[0]]
    assert kv.num_free_blocks == 6
    fresh = kv.allocate_slots("c", 2 * 4)  # 4 blocks: the 3 free ones first, then evict a's tail
    assert set(fresh[:3]) == {a[2], b[1], 5} and fresh[3] == a[1]
    assert kv.index.evictable_order() == [a[0], b[0]] and kv.num_cached_blocks == 2
    assert kv.cached_prefix(_chain([1, 2, 3, 4], 2)) == [a[0]]  # a's tail is gone, its head is not
    assert kv.cached_prefix(_chain([7, 8], 2)) == [b[0]]
    kv.allocate_slots("d", 2)
    assert kv.cached_prefix(_chain([1, 2], 2)) == [] and kv.index.evictable_order() == [b[0]]


def test_a_hit_on_an_evictable_block_is_not_also_counted_as_free():
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    _fill(kv, "a", [1, 2, 3])
    kv.free("a")
    cached = kv.cached_prefix(_chain([1, 2], 2))
    assert kv.num_free_blocks == 2 and len(cached) == 1
    # 3 blocks needed: 1 cached + 2 fresh, but the cached one is one of the 2 "free" ones
    assert kv.allocate_slots("b", 6, cached) is None
    assert kv.ref_count(cached[0]) == 0 and kv.index.is_evictable(cached[0])
    assert kv.allocate_slots("b", 4, cached) is not None


def test_a_duplicate_block_stays_unindexed_and_is_freed_plainly():
    kv = KVCacheManager(num_blocks=6, block_size=2, enable_prefix_caching=True)
    a = kv.allocate_slots("a", 3)
    b = kv.allocate_slots("b", 3)  # same tokens computed twice (admitted in the same step)
    hashes = _chain([1, 2, 3], 2)
    kv.cache_blocks("a", hashes, 1)
    kv.cache_blocks("b", hashes, 1)
    assert kv.cached_prefix(hashes) == [a[0]]
    kv.free("b")
    assert b[0] not in kv.index and kv.num_cached_blocks == 1


def test_index_refuses_a_second_hash_for_one_block():
    index = BlockHashIndex()
    assert index.add(3, b"x")
    assert not index.add(4, b"x")
    with pytest.raises(ValueError):
        index.add(3, b"y")


# -- random operations on the manager against a reference model of LRU --------------------------
manager_ops = st.lists(
    st.tuples(st.sampled_from(["add", "add", "free"]), st.integers(0, 5), st.integers(0, 3), st.integers(1, 14)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 10), block_size=st.integers(1, 4), ops=manager_ops)
def test_random_manager_operations_keep_counts_and_evict_lru(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    bases = [[seed * 10 + i % 3 for i in range(14)] for seed in range(4)]
    contents: dict[str, list[int]] = {}
    for op, request_index, base, length in ops:
        request_id = f"r{request_index}"
        if op == "free" or request_id in contents:
            kv.free(request_id)
            contents.pop(request_id, None)
        else:
            tokens = bases[base][:length]
            hashes = _chain(tokens, block_size)
            cached = kv.cached_prefix(hashes[: (length - 1) // block_size])
            expected_evictions = kv.index.evictable_order()
            free_before = kv.num_free_blocks
            table = kv.allocate_slots(request_id, length, cached)
            if table is None:
                assert kv.block_table(request_id) == []
                assert kv.num_free_blocks == free_before
            else:
                assert table[: len(cached)] == cached
                fresh = table[len(cached) :]
                assert all(kv.ref_count(block) == 1 for block in fresh), "a fresh block is shared"
                evicted = [block for block in fresh if block in expected_evictions]
                remaining = [block for block in expected_evictions if block not in cached]
                assert evicted == remaining[: len(evicted)], "eviction is not least recently released first"
                kv.cache_blocks(request_id, hashes, length // block_size)
                contents[request_id] = tokens
        _check_manager(kv, contents)
    for request_id in list(contents):
        kv.free(request_id)
    assert kv.num_free_blocks == num_blocks


def _check_manager(kv: KVCacheManager, contents: dict[str, list[int]]) -> None:
    counts = collections.Counter(block for request_id in kv.holders() for block in kv.block_table(request_id))
    for block in range(kv.num_blocks):
        assert kv.ref_count(block) == counts[block], f"block {block}: wrong reference count"
        if block in kv.index:
            assert kv.index.is_evictable(block) == (counts[block] == 0)
        else:
            assert not kv.index.is_evictable(block)
    assert len(counts) + kv.num_free_blocks == kv.num_blocks, "a block leaked"
    for request_id, tokens in contents.items():  # every indexed block holds what its hash names
        hashes = _chain(tokens, kv.block_size)
        for position, block in enumerate(kv.block_table(request_id)):
            if block in kv.index:
                assert kv.index.hash_of(block) == hashes[position]


# -- the scheduler over random streams, with a shadow of the KV slots ---------------------------
class ShadowModel:
    """Fake forward passes: each step 'writes' into every computed slot the prefix that produced
    it, and checks that every slot a request reads holds its own prefix. Sharing a block being
    written, or evicting or recycling a block still in use, shows up as a mismatch."""

    def __init__(self, scheduler: Scheduler, requests: dict[str, Request]):
        self.scheduler, self.requests = scheduler, requests
        self.kv = scheduler.kv
        self.slots: dict[int, tuple[int, ...]] = {}
        self.num_computed_tokens = 0

    def _slot(self, table: list[int], position: int) -> int:
        return table[position // self.kv.block_size] * self.kv.block_size + position % self.kv.block_size

    def step(self):
        plan = self.scheduler.schedule()
        for item in plan.scheduled:
            request = self.requests[item.request_id]
            start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
            tokens = request.token_ids(0, end)
            for block in item.block_ids[start // self.kv.block_size :]:  # blocks written this step
                assert self.kv.ref_count(block) == 1, "a block being written is shared"
                assert self.kv.index is None or block not in self.kv.index, "a block being written is indexed"
            self._check_reads(item.block_ids, tokens[:start])
        for item in plan.scheduled:
            tokens = self.requests[item.request_id].token_ids(0, item.num_computed_tokens + item.num_new_tokens)
            for position in range(item.num_computed_tokens, len(tokens)):
                self.slots[self._slot(item.block_ids, position)] = tuple(tokens[: position + 1])
            self.num_computed_tokens += item.num_new_tokens
        self.scheduler.update(plan, self.requests)
        for item in plan.scheduled:
            request = self.requests[item.request_id]
            if item.sample:
                request.output_token_ids.append(sum(request.token_ids(0, request.num_tokens)) % 3)
        for request in self.scheduler.running:  # nobody's computed slots were overwritten
            self._check_reads(
                self.kv.block_table(request.request_id), request.token_ids(0, request.num_computed_tokens)
            )
        return plan

    def _check_reads(self, table: list[int], tokens: list[int]) -> None:
        for position in range(len(tokens)):
            assert self.slots.get(self._slot(table, position)) == tuple(tokens[: position + 1]), (
                f"slot of position {position} holds another prefix"
            )


def _run_stream(arrivals, aborts, num_blocks, budget, block_size, max_seqs=None, prefix_caching=True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(
        kv, max_batch_prefill_tokens=budget, max_batch_size=max_seqs, prefix_cache=PrefixCache(kv, SALT)
    )
    requests: dict[str, Request] = {}
    bases = [[(seed * 7 + i * i) % 5 for i in range(60)] for seed in range(3)]
    capacity = num_blocks * block_size
    for index, (base, shared, suffix, max_new, logprobs) in enumerate(arrivals):
        tokens = bases[base][:shared] + [(index + i) % 4 for i in range(suffix)]
        tokens = tokens[: capacity - max_new]  # what validation guarantees
        if tokens:
            requests[f"r{index}"] = _request(f"r{index}", tokens, max_new, prompt_logprobs=logprobs)
    model = ShadowModel(scheduler, requests)
    pending = list(requests.values())
    for step in range(3000):
        if pending:
            scheduler.add(pending.pop(0))
            if step % 3 == 0 and pending:  # sometimes two arrive together
                scheduler.add(pending.pop(0))
        if step in aborts:
            victims = scheduler.running or list(scheduler.waiting)
            if victims:
                scheduler.finish(victims[len(victims) // 2], RequestStatus.FINISHED_ABORTED)
        model.step()
        assert kv.num_free_blocks + len({b for r in kv.holders() for b in kv.block_table(r)}) == num_blocks
        for request in list(scheduler.running):
            if request.num_output_tokens >= request.stopping.max_new_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        if not pending and scheduler.num_unfinished == 0:
            break
    assert scheduler.num_unfinished == 0, "a request never finished"
    assert kv.num_free_blocks == num_blocks and kv.holders() == []
    assert scheduler.prefix.num_claims == 0
    return requests, model, scheduler


arrival = st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(0, 12), st.integers(1, 8), st.booleans())


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(arrival, min_size=1, max_size=14),
    aborts=st.lists(st.integers(0, 60), max_size=4),
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 32),
    block_size=st.sampled_from([1, 2, 4]),
    max_seqs=st.one_of(st.none(), st.integers(1, 5)),
)
def test_random_streams_with_shared_prefixes_keep_every_slot_right(
    arrivals, aborts, num_blocks, budget, block_size, max_seqs
):
    requests, _, scheduler = _run_stream(arrivals, aborts, num_blocks, budget, block_size, max_seqs)
    for request in requests.values():
        assert request.status.is_finished
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.stopping.max_new_tokens
    assert scheduler.prefix.num_hit_tokens <= scheduler.prefix.num_queried_tokens


def test_outputs_and_work_with_and_without_prefix_caching():
    rng = random.Random(0)
    arrivals = [
        (rng.randrange(3), rng.randrange(20, 41), rng.randrange(0, 9), rng.randrange(1, 8), False) for _ in range(12)
    ]
    arrivals.append((0, 40, 0, 3, True))  # prompt logprobs: computes its whole prompt
    on, model_on, scheduler = _run_stream(arrivals, [], num_blocks=200, budget=16, block_size=4)
    off, model_off, scheduler_off = _run_stream(
        arrivals, [], num_blocks=200, budget=16, block_size=4, prefix_caching=False
    )
    assert scheduler.num_preemptions == scheduler_off.num_preemptions == 0
    assert {r: q.output_token_ids for r, q in on.items()} == {r: q.output_token_ids for r, q in off.items()}
    assert scheduler.prefix.num_hit_tokens > 0  # (adoption has its own tests below)
    assert model_on.num_computed_tokens + scheduler.prefix.num_hit_tokens == model_off.num_computed_tokens
    assert on["r12"].timings.num_cached_tokens == 0


def test_requests_with_one_prompt_wait_for_it_to_be_computed_once():
    """best_of / n: variants of one prompt arriving together compute it once, not once each."""
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=16, prefix_cache=PrefixCache(kv, SALT))
    prompt = list(range(30))
    requests = {f"v{i}": _request(f"v{i}", prompt, max_new=3) for i in range(3)}
    other = _request("other", [99] * 5, max_new=3)
    requests["other"] = other
    for request in requests.values():
        scheduler.add(request)
    model = ShadowModel(scheduler, requests)
    plan = model.step()
    # v1 and v2 wait for v0's blocks; the unrelated request is not held up behind them
    assert [s.request_id for s in plan.scheduled] == ["v0", "other"]
    prompt_tokens_computed = 0
    while "v1" not in plan.admitted_ids:
        prompt_tokens_computed += sum(
            max(0, min(s.num_computed_tokens + s.num_new_tokens, 30) - s.num_computed_tokens)
            for s in plan.scheduled
            if s.request_id.startswith("v")
        )
        plan = model.step()
    hits = {s.request_id: s.num_computed_tokens for s in plan.scheduled if s.request_id in plan.admitted_ids}
    assert hits == {"v1": 28, "v2": 28}  # 7 full blocks; the last 2 tokens are computed
    prompt_tokens_computed += sum(s.num_new_tokens for s in plan.scheduled if s.request_id in hits)
    assert prompt_tokens_computed == 30 + 2 * 2  # the shared prompt computed once
    assert len({tuple(kv.block_table(v)[:7]) for v in ("v0", "v1", "v2")}) == 1


# -- LoRA adapters ------------------------------------------------------------------------------
def _adapter_request(request_id: str, tokens: list[int], adapter_id: str | None) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), StoppingParams(4), adapter_id=adapter_id)


def test_adapters_never_share_kv_with_the_base_or_each_other():
    """The chain of an adapter's request starts from the adapter's own salt: the same tokens under
    another adapter (or the base) hit nothing; under the same adapter they hit."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    salts = {"fr": cache_salt(SALT.hex(), "lora", "fr"), "de": cache_salt(SALT.hex(), "lora", "de")}
    prefix = PrefixCache(kv, SALT, adapter_salt=salts.__getitem__)
    tokens = list(range(9))
    for request_id, adapter in (("base", None), ("fr", "fr")):
        request = _adapter_request(request_id, tokens, adapter)
        assert kv.allocate_slots(request_id, len(tokens)) is not None
        request.num_computed_tokens = len(tokens)
        prefix.computed(request)
        kv.free(request_id)
    assert prefix.lookup(_adapter_request("base2", tokens, None)).num_tokens == 8
    assert prefix.lookup(_adapter_request("fr2", tokens, "fr")).num_tokens == 8
    assert prefix.lookup(_adapter_request("de", tokens, "de")).num_tokens == 0
    assert _adapter_request("x", tokens, "fr").block_hashes == []
    fr = _adapter_request("fr3", tokens, "fr")
    prefix.lookup(fr)
    assert fr.block_hashes[0] == hash_block(salts["fr"], tokens[:4]) != _chain(tokens, 4)[0]


def test_an_adapter_request_without_adapter_salts_is_refused():
    prefix = PrefixCache(KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True), SALT)
    with pytest.raises(ValueError, match="names a LoRA adapter"):
        prefix.lookup(_adapter_request("a", list(range(9)), "fr"))


# -- partial blocks: a follow-up runs on into part of a cached block -----------------------------
def test_a_released_partial_block_is_kept_and_adopted_by_a_request_sharing_its_first_tokens():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = _fill(kv, "a", [1, 2, 3, 4, 5, 6])  # 1 full block + 2 computed tokens of the next
    origin = BlockOrigin(_chain([1, 2, 3, 4], 4)[0], (5, 6))
    kv.keep_tail("a", 1, origin)
    kv.free("a")
    assert kv.index.evictable_order() == [a[1], a[0]]  # the tail first: evicted before its head
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 6
    assert kv.partial_match(origin.parent, (5, 6, 9)) == (a[1], 2)
    assert kv.partial_match(origin.parent, (5, 7)) == (a[1], 1)
    assert kv.partial_match(origin.parent, (6,)) is None  # not even the first token
    assert kv.partial_match(SALT, (5, 6)) is None  # another place in another chain
    table = kv.allocate_slots("b", 8, [a[0]], adopted=a[1])
    assert table == [a[0], a[1]] and kv.ref_count(a[1]) == 1
    assert a[1] not in kv.index and kv.index.evictable_order() == []  # the request's own block now
    kv.cache_blocks("b", _chain([1, 2, 3, 4, 5, 6, 9, 9], 4), 2)  # indexed anew once full
    assert kv.cached_prefix(_chain([1, 2, 3, 4, 5, 6, 9, 9], 4)) == [a[0], a[1]]
    kv.free("b")
    assert kv.num_free_blocks == 6


def test_only_an_evictable_block_can_be_adopted_and_the_longest_match_wins():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    hashes = _chain([1, 2, 3, 4, 5, 6, 7, 8], 4)
    tokens = (1, 2, 3, 4, 5, 6, 7, 8)

    def origin(position: int) -> BlockOrigin:
        return BlockOrigin(hashes[position - 1] if position else SALT, tokens[4 * position : 4 * position + 4])

    table = kv.allocate_slots("a", 8)
    kv.cache_blocks("a", hashes, 2, origin)
    assert kv.partial_match(hashes[0], (5, 6, 0)) is None  # held: its holder reads every slot
    kv.free("a")
    assert kv.partial_match(hashes[0], (5, 6, 0)) == (table[1], 2)
    kv.allocate_slots("t", 4)
    kv.keep_tail("t", 0, BlockOrigin(hashes[0], (5, 6, 7)))
    tail = kv.block_table("t")[0]
    kv.free("t")
    assert kv.partial_match(hashes[0], (5, 6, 7, 0)) == (tail, 3)
    with pytest.raises(ValueError, match="cannot be adopted"):
        kv.allocate_slots("b", 8, [table[0]], adopted=table[0] + 100)
    fresh = kv.allocate_slots("c", 4 * 6)  # 6 blocks: 5 free, then the least recent evictable one
    assert table[1] in fresh and kv.partial_match(hashes[0], (5, 6, 0)) == (tail, 2)  # evicted: forgotten
    kv.free("c")
    assert kv.num_free_blocks == 8


def _follow_up_run(block_size: int, first: list[int], follow, max_new: int = 5):
    """A first request run to its end, then a second whose prompt is `follow` (or `follow(first)`)."""
    kv = KVCacheManager(64, block_size, enable_prefix_caching=True)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64, max_batch_size=None, prefix_cache=PrefixCache(kv, SALT))
    requests = {"first": _request("first", first, max_new)}
    model = ShadowModel(scheduler, requests)
    scheduler.add(requests["first"])
    while scheduler.num_unfinished:
        model.step()
        for request in list(scheduler.running):
            if request.num_output_tokens >= request.stopping.max_new_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    done = requests["first"]
    requests["second"] = _request("second", follow(done) if callable(follow) else follow, 2)
    scheduler.add(requests["second"])
    computed_before = model.num_computed_tokens
    while scheduler.num_unfinished:  # the shadow checks every reused slot holds the right prefix
        model.step()
        for request in list(scheduler.running):
            if request.num_output_tokens >= request.stopping.max_new_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
    assert kv.num_free_blocks == kv.num_blocks and kv.holders() == []
    return done, requests["second"], model.num_computed_tokens - computed_before, scheduler


def test_a_follow_up_reuses_the_first_turn_with_its_generated_tokens_and_partial_last_block():
    prompt = list(range(10, 21))  # 11 tokens, blocks of 4: the reply's tokens run through 4 blocks
    done, second, computed, scheduler = _follow_up_run(4, prompt, lambda done: done.all_token_ids() + [7, 7, 7])
    # every token the first turn computed (all but its last sampled one) is reused
    assert second.timings.num_cached_tokens == done.num_tokens - 1 == 15
    assert computed == second.num_prompt_tokens - 15 + 1  # the rest of the prompt, then one decode step
    assert scheduler.prefix.num_adopted_blocks == 1


def test_a_follow_up_that_differs_inside_a_block_reuses_up_to_the_difference():
    prompt = list(range(10, 22))  # 3 full blocks, the last one ending its chain (1 token sampled, never run)
    _, second, _, scheduler = _follow_up_run(4, prompt, prompt[:10] + [99, 98, 97], max_new=1)
    assert second.timings.num_cached_tokens == 10 and scheduler.prefix.num_adopted_blocks == 1


def test_a_prompt_that_only_starts_like_a_tail_leaves_it_in_the_index():
    prompt = list(range(10, 22))  # its last block [18..21] ends the chain
    _, second, _, scheduler = _follow_up_run(4, prompt, prompt[:9] + [99, 98, 97], max_new=1)
    assert second.timings.num_cached_tokens == 8 and scheduler.prefix.num_adopted_blocks == 0


def test_the_same_prompt_again_reuses_all_but_its_last_token_at_any_length():
    for length in (11, 12, 13):  # the first request's tail holds its one computed output token
        prompt = list(range(10, 10 + length))
        _, second, computed, _ = _follow_up_run(4, prompt, prompt, max_new=2)
        assert second.timings.num_cached_tokens == length - 1 and computed == 2


def test_a_partial_hit_never_ends_inside_a_both_way_span():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    prefix = PrefixCache(kv, SALT)
    table = kv.allocate_slots("a", 8)
    kv.keep_tail("a", 1, BlockOrigin(_chain([1, 2, 3, 4], 4)[0], (5, 6, 7)))
    kv.cache_blocks("a", _chain([1, 2, 3, 4], 4), 1, lambda _: BlockOrigin(SALT, (1, 2, 3, 4)))
    kv.free("a")
    request = _request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert prefix.lookup(request) == PrefixHit([table[0]], 7, adopted_block=table[1])
    request.images = (ImageInput(positions=(5, 6, 7), pixel_values=None, content_hash=b"x" * 32, span=(5, 8)),)
    assert prefix.lookup(request) == PrefixHit([table[0]], 5, adopted_block=table[1])
    request.images = (ImageInput(positions=(4, 5, 6, 7), pixel_values=None, content_hash=b"x" * 32, span=(4, 8)),)
    assert prefix.lookup(request) == PrefixHit([table[0]], 4)


def test_a_block_that_a_cached_chain_goes_on_through_is_never_adopted():
    """A shared system prompt's last block, followed by one conversation's cached blocks: another
    conversation differing inside it computes it afresh rather than cut the first one's chain."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    hashes = _chain(tokens, 4)

    def origin(position: int) -> BlockOrigin:
        return BlockOrigin(hashes[position - 1] if position else SALT, tuple(tokens[4 * position : 4 * position + 4]))

    table = kv.allocate_slots("a", 12)
    kv.cache_blocks("a", hashes, 3, origin)
    kv.free("a")
    assert kv.partial_match(hashes[0], (5, 6, 0)) is None  # block 1 is followed by block 2
    assert kv.partial_match(hashes[1], (9, 10, 0)) == (table[2], 2)  # block 2 ends the chain
    assert kv.partial_match(hashes[1], (9, 0, 0)) is None  # one equal token of four: not worth taking it
    kv.allocate_slots("t", 4)
    kv.keep_tail("t", 0, BlockOrigin(hashes[2], (13,)))
    kv.free("t")
    assert kv.partial_match(hashes[1], (9, 10, 0)) == (table[2], 2)  # a tail after it does not count
    kv.allocate_slots("b", 4 * 5)  # 5 blocks: 4 free, then block 2 (released first) is evicted
    assert kv.partial_match(hashes[0], (5, 6, 0)) == (table[1], 2)  # nothing follows block 1 now
