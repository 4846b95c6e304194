"""When a step gives way (engine/step_yield.py), decided without a model: a "forward pass" here is
`poll` called once per layer, as the paged attention function calls it."""

from __future__ import annotations

import pytest

from inference_service.engine.step_yield import StepYield
from inference_service.outputs import ScheduledRequest
from inference_service.worker import step_yield as worker_yield
from inference_service.worker.step_yield import StepYielded

NUM_LAYERS = 4


def _chunk(request_id: str, sample: bool = False, start: int = 0, count: int = 8) -> ScheduledRequest:
    return ScheduledRequest(request_id, start, count, list(range(count)), [0, 1], sample=sample)


def _forward() -> None:
    for layer in range(NUM_LAYERS):
        worker_yield.poll(layer, NUM_LAYERS)


def _step(steps: StepYield, scheduled: list[ScheduledRequest], fixed_s: float | None = None) -> bool:
    """Run one step; True if it gave way."""
    try:
        with steps.running(scheduled, fixed_s):
            _forward()
    except StepYielded:
        return True
    return False


def test_a_lone_prefill_step_gives_way_only_while_an_arrival_waits():
    steps = StepYield()
    assert not _step(steps, [_chunk("long")])
    steps.arrivals.coming()
    assert _step(steps, [_chunk("long")])
    steps.arrivals.taken()
    assert not _step(steps, [_chunk("long"), _chunk("short", sample=True)])
    assert steps.num_yields == 1


def test_a_step_that_gives_a_stream_or_a_short_prompt_a_token_runs_whole():
    steps = StepYield()
    steps.arrivals.coming()
    assert not _step(steps, [_chunk("long"), _chunk("decode", sample=True, start=20, count=1)])
    assert not _step(steps, [_chunk("long"), _chunk("short", sample=True)])  # a prompt run whole
    # A long prompt's last chunk gives way (its first token was a long wait anyway).
    assert _step(steps, [_chunk("long", sample=True, start=64)])
    steps.enabled = False
    assert not _step(steps, [_chunk("long")])


class _Clock:
    """Step time as the test says: each layer run takes a second."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_yields_that_change_nothing_are_capped_and_the_others_are_not(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr("inference_service.engine.step_yield.time", clock)
    steps = StepYield()

    def step(scheduled: list[ScheduledRequest], arrive_at: int | None = None) -> bool:
        try:
            with steps.running(scheduled, None):
                for layer in range(NUM_LAYERS):
                    if layer == arrive_at:
                        steps.arrivals.coming()
                    worker_yield.poll(layer, NUM_LAYERS)
                    clock.now += 1
        except StepYielded:
            return True
        finally:
            if arrive_at is not None:
                steps.arrivals.taken()
        return False

    long = [_chunk("long")]
    assert not step(long)  # 4 s run whole: 0.8 s of waste allowed
    assert step(long, arrive_at=2)  # 2 s thrown away...
    assert not step(long)  # ...for nothing (the same requests again): 1.2 s over; 0.4 s after this step
    assert not step(long, arrive_at=2)  # still over: it runs whole though a request arrives (0.4 s allowed)
    assert step(long, arrive_at=2)  # so this one gives way...
    assert step(long + [_chunk("short")], arrive_at=2)  # ...and the request it gave way to came in:
    assert step(long + [_chunk("other")], arrive_at=2)  # those yields are not charged
    assert steps.num_yields == 4 and steps.wasted_s == 8


def test_outside_a_yielding_step_and_under_never_nothing_gives_way():
    _forward()  # no step context: nothing to ask
    steps = StepYield()
    steps.arrivals.coming()
    with pytest.raises(StepYielded), steps.running([_chunk("long")], None):
        _forward()
    with steps.running([_chunk("long")], None), worker_yield.never():
        _forward()  # shard 0 of a tensor-parallel model runs every layer
