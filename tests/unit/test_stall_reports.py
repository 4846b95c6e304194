"""The server's stall reports: a long garbage collection (engine/gc_pauses.py), a slow engine-loop
turn (engine/slow_turns.py) and a late API event loop (api/loop_lag.py) are each logged with where
the time went, ordinary ones are not; and the hostile soak reads the lines the log really has back."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from inference_service.api.loop_lag import watch_loop_lag
from inference_service.engine.gc_pauses import GcClock
from inference_service.engine.slow_turns import MIN_SLOW_S, SlowTurns
from inference_service.observability.logging import TextFormatter
from inference_service.outputs import StepStats
from tests.e2e.soak_attribution import Overlaps, Span, server_stalls


def step(forward_s: float = 0.001, num_decode_tokens: int = 2) -> StepStats:
    return StepStats(
        num_requests=3,
        num_new_requests=0,
        num_prefill_requests=1,
        num_prefill_tokens=16,
        num_decode_tokens=num_decode_tokens,
        num_preempted=0,
        batch_max_tokens=0,
        forward_s=forward_s,
    )


def spin(cpu_seconds: float) -> None:
    """Run on the CPU this long (a busy machine stretches the wall time, not this)."""
    end = time.thread_time() + cpu_seconds
    while time.thread_time() < end:
        pass


def test_gc_clock_adds_up_collections_and_logs_the_long_ones(caplog):
    clock, quiet = GcClock(long_s=0.0), GcClock(long_s=60.0)
    with caplog.at_level(logging.WARNING, logger="inference_service.engine.gc_pauses"):
        gc.collect()
    clock.close()
    quiet.close()
    assert clock.total_s > 0 and quiet.total_s > 0
    assert clock.num_long >= 1 and quiet.num_long == 0
    assert "long garbage collection" in caplog.text and "generation 2" in caplog.text


def test_a_slow_turn_is_logged_with_its_steps_and_cpu_the_usual_ones_idle_waits_and_lone_prompts_are_not(caplog):
    turns = SlowTurns()
    with caplog.at_level(logging.WARNING, logger="inference_service.engine.slow_turns"):
        for _ in range(5):
            turns.start()
            turns.end([step()], commands_s=0.0, num_commands=0)
        turns.start()
        time.sleep(MIN_SLOW_S * 2)  # an idle wait: no step, no command
        turns.end([], commands_s=0.0, num_commands=0)
        turns.start()
        time.sleep(MIN_SLOW_S * 2)  # a step of prompts only: no stream waited
        turns.end([step(num_decode_tokens=0)], commands_s=0.0, num_commands=1)
        assert caplog.records == []
        turns.start()
        time.sleep(MIN_SLOW_S * 2)  # off the CPU
        turns.end([step()], commands_s=0.0, num_commands=0)
        turns.start()
        spin(MIN_SLOW_S * 2)  # on it
        turns.end([step(forward_s=MIN_SLOW_S * 2)], commands_s=0.0, num_commands=1)
    asleep, busy = (record.fields for record in caplog.records)  # type: ignore[attr-defined]
    assert turns.num_slow == 2
    assert busy["on_cpu_s"] >= MIN_SLOW_S * 2 and busy["forward_s"] >= MIN_SLOW_S
    assert (busy["rows"], busy["prefill_tokens"], busy["decode_tokens"], busy["commands"]) == (3, 16, 2, 1)
    assert asleep["on_cpu_s"] < MIN_SLOW_S / 2 and asleep["waited"] >= 1
    turns.gc_clock.close()


def test_a_blocked_event_loop_is_logged_with_whether_it_was_on_the_cpu(caplog):
    async def block_twice():
        clock = GcClock()
        watch = asyncio.ensure_future(watch_loop_lag(clock, tick_s=0.01, late_s=0.05))
        await asyncio.sleep(0.05)
        spin(0.12)  # a callback holding the loop
        await asyncio.sleep(0.05)
        time.sleep(0.12)  # the loop thread off the CPU
        await asyncio.sleep(0.05)
        watch.cancel()
        clock.close()

    with caplog.at_level(logging.WARNING, logger="inference_service.api.loop_lag"):
        asyncio.run(block_twice())
    late = [record.fields for record in caplog.records]  # type: ignore[attr-defined]
    assert len(late) == 2, late
    assert late[0]["late_s"] >= 0.1 and late[0]["on_cpu_s"] >= 0.12
    assert late[1]["late_s"] >= 0.1 and late[1]["on_cpu_s"] < 0.05


def test_the_soak_reads_the_stall_lines_back_in_its_own_clock():
    record = logging.LogRecord("inference_service.engine.slow_turns", logging.WARNING, "", 0, "", None, None)
    record.msg, record.args = (
        "slow engine turn: %.0f ms, usually %.0f ms; every running request waited for it",
        (
            250.0,
            15.0,
        ),
    )
    record.fields = {"on_cpu_s": 0.03, "preempted": 10, "waited": 0}
    line = TextFormatter().format(record)
    offset = time.monotonic() - time.time()
    (stall,) = server_stalls(["unrelated line", line], offset)
    assert stall.what == "engine turn" and stall.detail == "on_cpu_s=0.03 preempted=10 waited=0"
    assert abs(stall.end - (record.created + offset)) < 0.002 and abs(stall.end - stall.start - 0.25) < 1e-6

    spans = Overlaps([Span("a", 0, 1), Span("b", 5, 9), Span("c", 2, 3)])
    assert [span.what for span in spans.over(0.5, 2.5)] == ["a", "c"]
    assert [span.what for span in spans.over(6, 7)] == ["b"] and spans.over(3.5, 4.5) == []
