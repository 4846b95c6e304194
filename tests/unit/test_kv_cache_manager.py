"""Block manager invariants under randomized schedules: no leak, no double use."""

from hypothesis import given, settings
from hypothesis import strategies as st

from inference_service.engine.kv_cache_manager import KVCacheManager


def _check_invariants(kv: KVCacheManager) -> None:
    held = [block for request_id in kv.holders() for block in kv.block_table(request_id)]
    assert len(held) == len(set(held)), "a block is owned twice"
    assert len(held) + kv.num_free_blocks == kv.num_blocks, "a block leaked"
    assert all(0 <= block < kv.num_blocks for block in held)


def test_allocate_grows_only_by_missing_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    first = kv.allocate_slots("a", 3)
    assert len(first) == 1
    assert kv.allocate_slots("a", 4) == first  # still fits in one block
    grown = kv.allocate_slots("a", 5)
    assert grown[:1] == first and len(grown) == 2
    assert kv.num_free_blocks == 2


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate_slots("a", 4)
    assert kv.allocate_slots("b", 3) is None
    assert kv.block_table("b") == []
    assert kv.num_free_blocks == 1
    _check_invariants(kv)


def test_free_returns_every_block_and_is_idempotent():
    kv = KVCacheManager(num_blocks=5, block_size=2)
    kv.allocate_slots("a", 7)
    kv.free("a")
    kv.free("a")
    kv.free("never-seen")
    assert kv.num_free_blocks == 5
    assert kv.holders() == []


operations = st.lists(
    st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 12), block_size=st.integers(1, 8), ops=operations)
def test_random_schedules_never_leak_or_share(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    sizes: dict[str, int] = {}
    for op, request_index, num_tokens in ops:
        request_id = f"r{request_index}"
        if op == "grow":
            target = sizes.get(request_id, 0) + num_tokens
            before = kv.block_table(request_id)
            table = kv.allocate_slots(request_id, target)
            if table is None:
                assert kv.block_table(request_id) == before
            else:
                assert table[: len(before)] == before, "existing blocks must not move"
                assert len(table) * block_size >= target
                sizes[request_id] = target
        else:
            kv.free(request_id)
            sizes.pop(request_id, None)
        _check_invariants(kv)
    for request_id in list(sizes):
        kv.free(request_id)
    assert kv.num_free_blocks == num_blocks
