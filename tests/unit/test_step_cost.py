"""The scheduler's cost model: chunks counted in work (tokens plus attention over their context), and
a small prefill pool in steps that carry streams. No model: fabricated outputs, as in test_scheduler."""

import math

from hypothesis import given
from hypothesis import strategies as st

from inference_service.engine.kv_cache_manager import KVCacheManager
from inference_service.engine.request import Request, RequestStatus
from inference_service.engine.scheduler import Scheduler
from inference_service.engine.step_cost import MIN_SHARE_OF_STATIC, STREAM_STEP_RATIO, StepClock, StepCost
from inference_service.sampling_params import SamplingParams, StoppingParams

COST = StepCost(context_scale=100, stream_share=1 / 8)


def _request(request_id: str, num_prompt: int, max_new: int = 4) -> Request:
    return Request(request_id, list(range(1, num_prompt + 1)), SamplingParams(), StoppingParams(max_new))


def _run_step(scheduler: Scheduler, requests: dict[str, Request]):
    plan = scheduler.schedule()
    scheduler.update(plan, requests)
    for item in plan.scheduled:
        if item.sample:
            requests[item.request_id].output_token_ids.append(7)
    return plan


def _prefill_work(plan, cost: StepCost, decodes: set[str]) -> float:
    return sum(
        cost.work(s.num_computed_tokens, s.num_new_tokens) for s in plan.scheduled if s.request_id not in decodes
    )


def test_work_is_tokens_at_position_zero_and_grows_with_the_context():
    assert StepCost().work(5000, 10) == 10  # the default counts tokens only
    assert COST.work(0, 1) == 1.01  # one token attends over itself
    assert COST.work(100, 10) == 10 + (10 * 100 + 55) / 100
    assert COST.work(1000, 10) > 10 * COST.work(0, 10)  # ten times the context scale: ~11× the work


@given(st.integers(0, 5000), st.integers(1, 300), st.integers(1, 300))
def test_work_adds_up_over_consecutive_chunks(start, first, second):
    assert math.isclose(COST.work(start, first + second), COST.work(start, first) + COST.work(start + first, second))


@given(st.integers(0, 20000), st.integers(1, 5000), st.floats(0.5, 2000), st.sampled_from([COST, StepCost()]))
def test_fit_takes_the_most_tokens_within_the_work(start, pending, work, cost):
    num = cost.fit(start, pending, work)
    assert 1 <= num <= pending  # a chunk always moves on
    if num > 1:
        assert cost.work(start, num) <= work
    if num < pending:
        assert cost.work(start, num + 1) > work


def test_a_lone_long_prompt_gets_fewer_tokens_per_step_as_its_context_grows():
    kv = KVCacheManager(num_blocks=512, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64, cost=COST)
    requests = {"long": _request("long", 1000)}
    scheduler.add(requests["long"])
    chunks = []
    while requests["long"].num_output_tokens == 0:
        plan = _run_step(scheduler, requests)
        (item,) = plan.scheduled
        chunks.append(item.num_new_tokens)
        work = COST.work(item.num_computed_tokens, item.num_new_tokens)
        assert work <= 64  # the budget bounds the step's work, not just its tokens
        if not item.sample:
            assert work > 64 - COST.work(item.num_computed_tokens + item.num_new_tokens, 1)  # and it is used whole
    assert chunks[0] > 2 * chunks[-2]  # a chunk at position ~1000 attends over 10× the context scale
    assert sum(chunks) == 1000


def test_a_stream_beside_a_long_prefill_waits_for_a_small_pool_only():
    kv = KVCacheManager(num_blocks=512, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64, cost=COST)
    requests = {"stream": _request("stream", 3, max_new=30), "long": _request("long", 600)}
    scheduler.add(requests["stream"])
    _run_step(scheduler, requests)
    scheduler.add(requests["long"])
    pool = 64 * COST.stream_share
    while requests["stream"].num_output_tokens < 30:
        before = requests["long"].num_computed_tokens
        plan = _run_step(scheduler, requests)
        assert plan.scheduled[0].request_id == "stream" and plan.scheduled[0].num_new_tokens == 1
        if requests["long"].num_output_tokens == 0:
            assert requests["long"].num_computed_tokens > before  # it moves on every step...
            # ...within the pool (a one-token chunk may exceed it at most by its own work)
            assert _prefill_work(plan, COST, {"stream"}) <= max(pool, COST.work(before, 1))
    assert 0 < requests["long"].num_computed_tokens < 600  # beside the stream, it went slower


def test_a_short_arrival_runs_in_a_small_step_beside_a_long_prefill():
    kv = KVCacheManager(num_blocks=512, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64, cost=COST)
    requests = {"long": _request("long", 600), "short": _request("short", 5, max_new=1)}
    scheduler.add(requests["long"])
    for _ in range(3):
        plan = _run_step(scheduler, requests)
        assert _prefill_work(plan, COST, set()) > 60  # alone, the long prompt uses the whole budget
    scheduler.add(requests["short"])
    plan = _run_step(scheduler, requests)
    by_id = {s.request_id: s for s in plan.scheduled}
    assert by_id["short"].sample and by_id["short"].num_new_tokens == 5  # its first token comes now
    long = by_id["long"]
    assert (
        long.num_new_tokens >= 1 and COST.work(long.num_computed_tokens, long.num_new_tokens) <= 64 * COST.stream_share
    )
    scheduler.finish(requests["short"], RequestStatus.FINISHED_LENGTH)
    plan = _run_step(scheduler, requests)
    assert _prefill_work(plan, COST, set()) > 60  # alone again: the whole budget


def test_the_stream_pool_grows_with_the_decodes_work():
    """Many streams: a step already costs their work, so the prefills may add as much."""
    assert COST.stream_pool(64, 2) == 8
    assert COST.stream_pool(64, 40) == 40
    assert StepCost().stream_pool(64, 2) == 64  # tokens only: the whole budget
    assert COST.stream_pool(64, 2, num_prompts=3) == 24  # a share per prompt still prefilling...
    assert COST.stream_pool(64, 2, num_prompts=20) == 64  # ...at most the budget


def test_a_burst_of_prompts_beside_streams_gets_a_share_each():
    """Four long prompts arrive while a stream decodes: the step's prefill work is four shares, not
    one shared by all four (a burst whose first prompts stream already keeps prefilling fast)."""
    kv = KVCacheManager(num_blocks=1024, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64, cost=COST)
    requests = {"stream": _request("stream", 3, max_new=30)}
    scheduler.add(requests["stream"])
    _run_step(scheduler, requests)
    share = 64 * COST.stream_share
    for index in range(4):
        requests[f"long{index}"] = _request(f"long{index}", 300)
        scheduler.add(requests[f"long{index}"])
    for _ in range(3):
        plan = _run_step(scheduler, requests)
        assert plan.scheduled[0].request_id == "stream" and plan.scheduled[0].num_new_tokens == 1
        assert len(plan.scheduled) == 5  # every prompt moves on
        work = _prefill_work(plan, COST, {"stream"})
        assert 3 * share < work <= 4 * share + COST.work(300, 1)  # a chunk may go one token over


def test_short_prompts_beside_a_stream_still_fill_the_budget():
    """The pool holds back chunks that leave their prompt for later, not prompts that end in the step."""
    kv = KVCacheManager(num_blocks=512, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64, cost=COST)
    requests = {"stream": _request("stream", 3, max_new=30)}
    scheduler.add(requests["stream"])
    _run_step(scheduler, requests)
    for index in range(5):
        requests[f"s{index}"] = _request(f"s{index}", 10, max_new=1)
        scheduler.add(requests[f"s{index}"])
    plan = _run_step(scheduler, requests)
    assert [(s.request_id, s.num_new_tokens, s.sample) for s in plan.scheduled] == [
        ("stream", 1, True),
        *((f"s{index}", 10, True) for index in range(5)),
    ]


# -- the clock: the stream share learned from step times --------------------------------------------
def test_the_clock_learns_a_steps_fixed_time_and_a_units_time():
    clock = StepClock()
    assert clock.share() is None  # nothing seen: the static share serves
    clock.observe(prefill_work=40, seconds=0.5)
    assert clock.share() is None  # a large step before any small one: its split is unknown
    for _ in range(30):
        clock.observe(prefill_work=2, seconds=0.03)  # decodes and a tiny prompt: the fixed cost
        clock.observe(prefill_work=100, seconds=0.03 + 100 * 0.002)  # a prefill: 2 ms per unit more
        clock.observe(prefill_work=20, seconds=9.0)  # in between: teaches neither
    assert math.isclose(clock.fixed_s, 0.03, rel_tol=1e-6)
    assert math.isclose(clock.per_work_s, 0.002, rel_tol=1e-3)
    # The share keeps a step carrying streams within STREAM_STEP_RATIO of its own time.
    assert math.isclose(clock.share(), (STREAM_STEP_RATIO - 1) * 0.03 / 0.002, rel_tol=1e-3)


def test_steps_beside_streams_correct_the_share_they_sized():
    """A small chunk deep into a long prompt costs more per unit than a large step's average (it reads
    its whole context's K/V for a few tokens): the steps held to the share teach its rate."""
    clock = StepClock()
    for _ in range(30):
        clock.observe(2, 0.03)
        clock.observe(100, 0.23)  # 2 ms per unit in a large step
    share = clock.share()
    for _ in range(30):
        clock.observe(share, 0.03 + share * 0.004, beside_streams=True)  # 4 ms per unit beside streams
    assert math.isclose(clock.fixed_s, 0.03) and math.isclose(clock.per_work_s, 0.002)  # untouched
    assert math.isclose(clock.share(), share / 2, rel_tol=1e-3)


def test_the_clock_follows_the_load():
    clock = StepClock()
    for _ in range(30):
        clock.observe(2, 0.03)
        clock.observe(100, 0.23)
    before = clock.share()
    for _ in range(30):  # the weights' read got slower (another process took the memory bandwidth)
        clock.observe(2, 0.06)
        clock.observe(100, 0.26)
    assert clock.share() > 1.5 * before


def test_the_stream_pool_is_the_learned_share_once_learned():
    clock = StepClock()
    cost = StepCost(context_scale=100, stream_share=1 / 8, clock=clock)
    assert cost.stream_pool(64, 2) == 8  # not learned yet: the static share
    clock.fixed_s, clock.per_work_s = 0.03, 0.006  # a share of 0.6 × 0.03 / 0.006 = 3 units
    assert math.isclose(cost.stream_pool(64, 1), 3)
    assert math.isclose(cost.stream_pool(64, 1, num_prompts=2), 6)  # a share per prompt
    assert cost.stream_pool(64, 1, num_prompts=100) == 64  # at most the budget
    assert cost.stream_pool(64, 40) == 40  # the decodes' own work still bounds it from below
    clock.per_work_s = 1.0  # a unit costs far more than the fixed time: the prompt still moves on
    assert cost.stream_pool(64, 1) == 8 * MIN_SHARE_OF_STATIC


def test_the_scheduler_times_its_steps_and_holds_a_long_prefill_to_the_learned_share():
    clock = StepClock()
    cost = StepCost(context_scale=100, stream_share=1 / 8, clock=clock)
    kv = KVCacheManager(num_blocks=512, block_size=4)
    scheduler = Scheduler(kv, max_batch_prefill_tokens=64, cost=cost)
    requests = {"stream": _request("stream", 3, max_new=30), "long": _request("long", 600)}
    scheduler.add(requests["stream"])
    _run_step(scheduler, requests)
    assert clock.fixed_s is not None  # the step was timed (a tiny prompt: the fixed cost)
    clock.fixed_s, clock.per_work_s = 0.03, 0.006  # as if learned: a share of 3 units
    clock.SMOOTHING = 0.0  # hold it there: this test's steps take microseconds
    scheduler.add(requests["long"])
    for _ in range(10):
        before = requests["long"].num_computed_tokens
        plan = _run_step(scheduler, requests)
        assert plan.scheduled[0].request_id == "stream"
        assert requests["long"].num_computed_tokens > before  # it moves on every step...
        assert _prefill_work(plan, cost, {"stream"}) <= max(3, cost.work(before, 1))  # ...by the share
