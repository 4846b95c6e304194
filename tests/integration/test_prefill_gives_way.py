"""A lone long prefill step gives way to a request that arrives during it (engine/step_yield.py):
the arrival is admitted, and answered, before the long prompt's prefill ends; the long prompt's
tokens still equal transformers'; no KV block is left held. The arrival is made inside the forward
pass by a hook on a decoder layer, so what is checked is the order of steps and events, not time."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.builder import build_engine
from inference_service.sampling_params import EngineRequest, SamplingParams, StoppingParams

BUDGET = 64  # tokens per step: the long prompt takes several lone steps
LONG = [(7 * i) % 200 + 3 for i in range(400)]
SHORT = [5, 17, 42, 99, 8]


def _greedy(prompt: list[int], max_new_tokens: int) -> EngineRequest:
    return EngineRequest(list(prompt), SamplingParams(), StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=max_new_tokens
        )
    return out[0, len(prompt) :].tolist()


def _engine(tiny_engine_config, timed: bool = False):
    engine = build_engine(
        dataclasses.replace(
            tiny_engine_config,
            cache=dataclasses.replace(tiny_engine_config.cache, block_size=4, prefix_caching=False),
            scheduler=SchedulerConfig(max_batch_prefill_tokens=BUDGET),
        )
    )
    if not timed:  # no clock: a step gives way at any layer, however close to its end (deterministic here)
        engine.scheduler.cost = dataclasses.replace(engine.scheduler.cost, clock=None)
    return engine


def _layer(engine, index: int) -> torch.nn.Module:
    """A module the forward pass calls inside decoder layer `index`: the decode plan's fused q|k|v
    projection where the plan runs prompt steps (Llama-style models on CPU), else transformers' layer."""
    plan = engine.runner.decode_step
    return plan.layers[index].qkv if plan is not None else engine.runner.model.model.layers[index]


def test_an_arrival_during_a_lone_prefill_step_is_answered_before_that_prefill_ends(tiny_engine_config, reference):
    engine = _engine(tiny_engine_config)
    engine.add_request("long", _greedy(LONG, 6))
    long = engine.live["long"].request
    arrived: list[int] = []

    def arrive(module, args):  # a front queues a request while layer 0's K/V of the chunk is written
        if not arrived:
            arrived.append(long.num_computed_tokens)
            engine.arrivals.coming()

    assert engine.step() == []  # a lone step runs whole while nobody arrives
    computed = long.num_computed_tokens
    assert 0 < computed < len(LONG)
    hook = _layer(engine, 1).register_forward_pre_hook(arrive)
    try:
        assert engine.step() == []
    finally:
        hook.remove()
    # The step gave way before its last layer: its chunk does not count, nothing was sampled.
    assert arrived == [computed] and engine.step_yield.num_yields == 1
    assert long.num_computed_tokens == computed and engine.num_steps == 1

    engine.arrivals.taken()  # the loop takes the command off its queue and applies it
    engine.add_request("short", _greedy(SHORT, 3))
    tokens: dict[str, list[int]] = {"long": [], "short": []}
    short_done_at = None
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None
            tokens[output.request_id] += [t.id for t in output.tokens]
            if output.request_id == "short" and output.finished:
                short_done_at = long.num_computed_tokens
    # The short request finished while the long prompt was still being prefilled...
    assert short_done_at is not None and short_done_at < len(LONG)
    # ...and both are transformers' tokens: the yielded step's K/V writes were written again.
    assert tokens == {"long": _reference_greedy(reference, LONG, 6), "short": _reference_greedy(reference, SHORT, 3)}
    assert engine.step_yield.num_yields == 1
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_arrivals_that_never_come_do_not_starve_the_long_prompt(tiny_engine_config, reference):
    """A command counted as coming that the loop never takes (the worst flood): every lone step may
    yield, but the waste is capped, so the long prompt still finishes, token for token."""
    engine = _engine(tiny_engine_config, timed=True)
    engine.add_request("long", _greedy(LONG, 4))
    engine.arrivals.coming()
    tokens: list[int] = []
    num_steps = 0
    while engine.has_unfinished():
        num_steps += 1
        assert num_steps < 1000
        for output in engine.step():
            assert output.error is None
            tokens += [t.id for t in output.tokens]
    assert engine.step_yield.num_yields >= 1
    assert tokens == _reference_greedy(reference, LONG, 4)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_a_request_sent_during_a_lone_prefill_step_through_the_async_engine_is_answered_first(
    tiny_engine_config, reference
):
    """The whole path: the request goes through `AsyncEngine.generate` while the engine thread is
    inside a lone step's forward pass; its answer comes before the long prompt's first token."""
    engine = _engine(tiny_engine_config)
    async_engine = AsyncEngine(engine, max_concurrent_requests=4)
    events: list[str] = []
    sent = threading.Event()
    step_sizes: list[int] = []  # requests per step run, in order (the engine thread's observer)
    engine.step_observer = lambda stats: step_sizes.append(stats.num_requests)
    sent_after: list[int] = []

    async def run() -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        short_task: list[asyncio.Task] = []

        def send_short(module, args):  # on the engine thread, in the first lone step's layer 1
            if not sent.is_set():
                sent.set()
                sent_after.append(len(step_sizes))
                loop.call_soon_threadsafe(lambda: short_task.append(loop.create_task(short())))
                for _ in range(1000):  # until the request is queued (the event loop runs meanwhile)
                    if engine.arrivals.waiting:
                        break
                    threading.Event().wait(0.01)

        async def short() -> list[int]:
            result = await async_engine.generate(_greedy(SHORT, 3))
            events.append("short answered")
            return [t.id for t in result.tokens]

        hook = _layer(engine, 1).register_forward_pre_hook(send_short)
        async_engine.start()
        try:
            long_tokens: list[int] = []
            async for output in async_engine.generate_stream(_greedy(LONG, 4)):
                if not long_tokens:
                    events.append("long's first token")
                long_tokens += [t.id for t in output.tokens]
            return long_tokens, await short_task[0]
        finally:
            hook.remove()
            await async_engine.shutdown(timeout_s=1)

    long_tokens, short_tokens = asyncio.run(run())
    assert engine.step_yield.num_yields == 1
    # The step the request was sent in never ran to its end: the next step run had it alone (the
    # long prompt's share given up for that step), and then both.
    assert step_sizes[sent_after[0] : sent_after[0] + 2] == [1, 2]
    assert events == ["short answered", "long's first token"]
    assert long_tokens == _reference_greedy(reference, LONG, 4)
    assert short_tokens == _reference_greedy(reference, SHORT, 3)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_core_process_loop_counts_what_comes_down_the_pipe_until_it_takes_it(tiny_engine_config):
    """The engine-core process's receiver counts a request and an abort as arriving once they are on
    the loop's queue (after any grammar compile), and the loop stops counting them as it applies them."""
    from multiprocessing import Pipe

    from inference_service.engine import core_wire as wire
    from inference_service.engine.core_process import CoreLoop

    engine = _engine(tiny_engine_config)
    ours, theirs = Pipe()
    loop = CoreLoop(engine, theirs)
    receiver = threading.Thread(target=loop._receive, daemon=True)
    receiver.start()
    try:
        ours.send(wire.AddRequest("a", wire.for_wire(_greedy(SHORT, 1))))
        ours.send(wire.AbortRequest("a", "request cancelled"))
        for _ in range(1000):  # until the receiver has queued both
            if loop.commands.qsize() == 2:
                break
            threading.Event().wait(0.01)
        assert loop.commands.qsize() == 2 and engine.arrivals.waiting
        outputs: list = []
        assert not loop._apply_commands(outputs)
        assert not engine.arrivals.waiting
        assert [output.request_id for output in outputs] == ["a"] and not engine.has_unfinished()
    finally:
        ours.close()
        receiver.join(5)
