"""Scheduler behaviour with fabricated model outputs: no model, no tensors."""

from hypothesis import given, settings
from hypothesis import strategies as st

from inference_service.engine.kv_cache_manager import KVCacheManager
from inference_service.engine.request import Request, RequestStatus
from inference_service.engine.scheduler import Scheduler
from inference_service.sampling_params import SamplingParams, StoppingParams


def _request(request_id: str, num_prompt: int, max_new: int = 4) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams(), StoppingParams(max_new))


def _run_step(scheduler: Scheduler, requests: dict[str, Request], next_token: int = 7):
    """One step: schedule, pretend the model ran, append a token to every sampled request."""
    plan = scheduler.schedule()
    scheduler.update(plan, requests)
    for item in plan.scheduled:
        if item.sample:
            requests[item.request_id].output_token_ids.append(next_token)
    return plan


def _finish_done(scheduler: Scheduler, requests: dict[str, Request]) -> None:
    for request in list(scheduler.running):
        if request.num_output_tokens >= request.stopping.max_new_tokens:
            scheduler.finish(request, RequestStatus.FINISHED_LENGTH)


def test_decodes_go_first_and_prefills_share_the_budget():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=10)
    requests = {r.request_id: r for r in (_request("a", 6), _request("b", 3), _request("c", 5))}
    for request in requests.values():
        scheduler.add(request)
    plan = _run_step(scheduler, requests)
    # a slice each (10 // 4 = 2 tokens), FIFO; the 4 left top up the prompts closest to done: b, then c
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in plan.scheduled] == [
        ("a", 2, False),
        ("b", 3, True),
        ("c", 5, True),
    ]
    plan = _run_step(scheduler, requests)
    # decodes first, then the rest of a's prompt
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in plan.scheduled] == [
        ("b", 3, 1),
        ("c", 5, 1),
        ("a", 2, 4),
    ]
    assert plan.scheduled[2].sample and plan.scheduled[2].token_ids == [3, 4, 5, 6]


def test_a_short_request_is_not_held_up_by_a_long_prefill():
    kv = KVCacheManager(num_blocks=128, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=16)
    requests = {"long": _request("long", 200), "short": _request("short", 3, max_new=4)}
    scheduler.add(requests["long"])
    for _ in range(2):
        plan = _run_step(scheduler, requests)
        assert [(s.request_id, s.num_new_tokens) for s in plan.scheduled] == [("long", 16)]  # alone: all of it
    scheduler.add(requests["short"])
    plan = _run_step(scheduler, requests)
    # the short prompt is prefilled whole in the next step; the long one goes on with the rest
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in plan.scheduled] == [
        ("long", 13, False),
        ("short", 3, True),
    ]
    while requests["short"].num_output_tokens < 4:
        plan = _run_step(scheduler, requests)
        # the short one decodes every step, first; the long prefill takes the rest of the budget
        assert [(s.request_id, s.num_new_tokens) for s in plan.scheduled] == [("short", 1), ("long", 15)]
    assert requests["long"].num_output_tokens == 0


def test_a_long_prefill_moves_on_beside_a_flood_of_short_prompts():
    kv = KVCacheManager(num_blocks=256, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=16)
    requests = {"long": _request("long", 100)}
    scheduler.add(requests["long"])
    count = 0
    while requests["long"].num_output_tokens == 0:
        for _ in range(4):  # more prompt tokens arrive each step than the budget holds
            request = _request(f"s{count}", 6, max_new=1)
            requests[request.request_id] = request
            scheduler.add(request)
            count += 1
        before = requests["long"].num_computed_tokens
        plan = _run_step(scheduler, requests)
        _finish_done(scheduler, requests)
        assert requests["long"].num_computed_tokens - before >= min(4, 100 - before)  # its slice, at least
        assert plan.num_tokens <= 16
    assert count <= 4 * 25


def test_long_prompt_is_prefilled_in_chunks_while_others_decode():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=8)
    requests = {"short": _request("short", 2, max_new=10), "long": _request("long", 20)}
    scheduler.add(requests["short"])
    _run_step(scheduler, requests)
    scheduler.add(requests["long"])
    chunks = []
    while requests["long"].num_output_tokens == 0:
        plan = _run_step(scheduler, requests)
        assert plan.scheduled[0].request_id == "short" and plan.scheduled[0].num_new_tokens == 1
        assert plan.num_tokens <= 8
        chunks.append(plan.scheduled[1].num_new_tokens)
    assert chunks == [7, 7, 6]


def test_max_batch_size_bounds_running_requests():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=100, max_batch_size=2)
    requests = {f"r{i}": _request(f"r{i}", 3) for i in range(4)}
    for request in requests.values():
        scheduler.add(request)
    plan = _run_step(scheduler, requests)
    assert [s.request_id for s in plan.scheduled] == ["r0", "r1"]
    assert len(scheduler.waiting) == 2


def test_newest_request_is_preempted_and_recomputed_with_its_output():
    kv = KVCacheManager(num_blocks=3, block_size=4)  # 12 slots
    scheduler = Scheduler(kv, max_batch_prefill_tokens=100)
    requests = {"old": _request("old", 4, max_new=6), "new": _request("new", 4, max_new=6)}
    scheduler.add(requests["old"])
    scheduler.add(requests["new"])
    _run_step(scheduler, requests)  # both prefilled: 2 blocks, each request has 1 output token
    plan = _run_step(scheduler, requests)  # old needs a 2nd block (1 free) → gets it; new needs one → none left
    assert plan.preempted_ids == ["new"]
    assert requests["new"].status == RequestStatus.PREEMPTED
    assert requests["new"].num_computed_tokens == 0 and requests["new"].output_token_ids == [7]
    assert scheduler.waiting[0] is requests["new"]
    while scheduler.running:
        _run_step(scheduler, requests)
        _finish_done(scheduler, requests)
    plan = _run_step(scheduler, requests)  # recompute: prompt + the token it had generated
    assert plan.scheduled[0].request_id == "new"
    assert plan.scheduled[0].token_ids == [1, 2, 3, 4, 7]
    assert requests["new"].timings.num_preemptions == 1


def test_finish_and_abort_free_blocks_at_once():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=100)
    requests = {"a": _request("a", 9), "b": _request("b", 2)}
    for request in requests.values():
        scheduler.add(request)
    _run_step(scheduler, requests)
    scheduler.finish(requests["a"], RequestStatus.FINISHED_ABORTED)
    assert kv.block_table("a") == []
    scheduler.add(_request("c", 3))
    scheduler.finish(scheduler.waiting[0], RequestStatus.FINISHED_ABORTED)  # abort while waiting
    scheduler.finish(requests["b"], RequestStatus.FINISHED_STOPPED)
    assert kv.num_free_blocks == 8 and scheduler.num_unfinished == 0


@settings(max_examples=150, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=12),
    aborts=st.lists(st.integers(0, 11), max_size=4),
    num_blocks=st.integers(6, 20),
    budget=st.integers(1, 24),
    max_seqs=st.one_of(st.none(), st.integers(1, 5)),
)
def test_random_workloads_finish_every_request_without_leaks(arrivals, aborts, num_blocks, budget, max_seqs):
    block_size = 4
    kv = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=budget, max_batch_size=max_seqs)
    capacity = num_blocks * block_size
    requests: dict[str, Request] = {}
    for index, (num_prompt, max_new) in enumerate(arrivals):
        num_prompt = min(num_prompt, capacity - max_new)  # what validation guarantees
        if num_prompt < 1:
            continue
        request = _request(f"r{index}", num_prompt, max_new)
        requests[request.request_id] = request
    pending = list(requests.values())
    for step in range(2000):
        if pending:
            scheduler.add(pending.pop(0))  # staggered arrivals
        if step in aborts:
            victims = scheduler.running or list(scheduler.waiting)
            if victims:
                scheduler.finish(victims[0], RequestStatus.FINISHED_ABORTED)
        plan = _run_step(scheduler, requests)
        for item in plan.scheduled:
            request = requests[item.request_id]
            assert len(kv.block_table(item.request_id)) * block_size >= request.num_computed_tokens
        held = [b for r in kv.holders() for b in kv.block_table(r)]
        assert len(held) == len(set(held)) and len(held) + kv.num_free_blocks == num_blocks
        assert set(kv.holders()) <= {r.request_id for r in scheduler.running}
        _finish_done(scheduler, requests)
        if not pending and scheduler.num_unfinished == 0:
            break
    assert scheduler.num_unfinished == 0, "a request never finished"
    assert kv.num_free_blocks == num_blocks
    for request in requests.values():
        assert request.status.is_finished
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.stopping.max_new_tokens


# -- speculation: guesses ride after a decode's known token --------------------------------------
def _decoding(scheduler: Scheduler, requests: dict[str, Request]) -> None:
    """Prefill every request and give it one generated token: each is now decoding."""
    for request in requests.values():
        scheduler.add(request)
    _run_step(scheduler, requests)


def test_guesses_run_after_the_known_token_and_count_once_accepted():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=32)
    requests = {"a": _request("a", 5, max_new=10)}
    _decoding(scheduler, requests)
    request = requests["a"]
    request.draft_token_ids = [11, 12, 13]
    plan = scheduler.schedule()
    (item,) = plan.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens, item.num_draft_tokens) == (5, 4, 3)
    assert item.token_ids == [7, 11, 12, 13] and item.sample and request.draft_token_ids == []
    assert len(item.block_ids) == kv.num_blocks_for(5 + 4)
    scheduler.update(plan, requests)
    assert request.num_computed_tokens == 6  # the known token only
    request.output_token_ids += [11, 12, 9]  # two guesses accepted, then the model's own token
    scheduler.accept_drafts(request, 2)
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    assert scheduler.schedule().scheduled[0].token_ids == [9]  # no guesses set: plain decode


def test_guesses_are_dropped_when_the_budget_is_short():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=6)
    requests = {name: _request(name, 3, max_new=10) for name in "ab"}
    _decoding(scheduler, requests)
    requests["a"].draft_token_ids = [1, 2, 3]
    requests["b"].draft_token_ids = [4, 5, 6]
    plan = scheduler.schedule()
    # a's known token and guesses take 4 of 6; b's guesses would overrun: b decodes plainly
    assert [(s.request_id, s.num_new_tokens, s.num_draft_tokens) for s in plan.scheduled] == [("a", 4, 3), ("b", 1, 0)]
    assert requests["b"].draft_token_ids == []


def test_guesses_never_cost_a_preemption():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64)
    requests = {name: _request(name, 4, max_new=10) for name in "ab"}  # one full block each
    _decoding(scheduler, requests)  # each now holds 2 blocks (5 tokens): the pool is empty
    requests["a"].draft_token_ids = [1, 2, 3, 4]  # would need a third block for a
    plan = scheduler.schedule()
    assert [(s.request_id, s.num_draft_tokens) for s in plan.scheduled] == [("a", 0), ("b", 0)]
    assert not plan.preempted_ids and scheduler.num_preemptions == 0


def test_a_preempted_request_forgets_its_guesses():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64)
    requests = {name: _request(name, 8, max_new=10) for name in "ab"}  # two full blocks each
    _decoding(scheduler, requests)
    requests["b"].draft_token_ids = [1, 2]
    plan = scheduler.schedule()  # a needs a third block: b, the newest, is preempted
    assert plan.preempted_ids == ["b"] and requests["b"].draft_token_ids == []


def test_a_large_batch_gets_no_guesses():
    from inference_service.engine.speculation import MAX_BATCH, Speculator
    from inference_service.sample.ngram_proposer import NgramProposer

    def decoding(count: int) -> list[Request]:
        requests = []
        for index in range(count):
            request = _request(f"r{index}", 6, max_new=10)
            request.prompt_token_ids = [1, 2, 3, 1, 2, 3]
            request.output_token_ids = [1]
            request.num_computed_tokens = 6
            requests.append(request)
        return requests

    speculator = Speculator(NgramProposer(), 4, max_total_tokens=512)
    small, large = decoding(MAX_BATCH), decoding(MAX_BATCH + 1)
    speculator.propose(small)
    speculator.propose(large)
    assert all(r.draft_token_ids == [2, 3, 1, 2] for r in small)
    assert not any(r.draft_token_ids for r in large)
