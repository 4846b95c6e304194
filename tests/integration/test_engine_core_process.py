"""The engine in its own process (engine/core_client.py, core_process.py) against the engine in this
one: the same tokens, logprobs, texts and grammars; aborts and finished requests leave no KV block
behind; and when the core process dies, every call in flight ends with ServerFailed (gRPC
UNAVAILABLE), new ones are refused, and the client reports its failure."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading

import pytest

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.core_client import CoreClient, refusal
from inference_service.errors import InferenceError, ServerFailed
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.outputs import StepStats
from inference_service.sample.grammar import GrammarSpec, GrammarTooComplex
from tests.engine_calls import idle, validated

REQUESTS = [
    ("the quick brown fox", {"max_new_tokens": 12, "details": True, "top_n_tokens": 2}),
    ("café naïve résumé", {"max_new_tokens": 9, "do_sample": True, "seed": 3, "temperature": 0.8, "top_k": 20}),
    ("a", {"max_new_tokens": 20, "stop": ["the"], "decoder_input_details": True, "details": True}),
    ("日本語", {"max_new_tokens": 10, "grammar": {"type": "regex", "value": "[ab]{3,6}"}}),
    ("birds sing", {"max_new_tokens": 16, "repetition_penalty": 1.3, "frequency_penalty": 0.2}),
]


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir)),
        cache=CacheConfig(block_size=4, max_batch_total_tokens=4096),
        limits=LimitsConfig(max_concurrent_requests=16),
    )


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """(the engine in this process, the engine in a core process) on the same model."""
    config = _config(tiny_model_dir)
    # A fork server: this test process already runs threads (a plain fork is for `serve`, before any).
    start = CoreClient.fork(config, start_method="forkserver")
    local = AsyncEngine.from_config(config)
    remote = start.wait(config)
    local.start()
    remote.start()
    yield local, remote
    asyncio.run(local.shutdown(timeout_s=1))
    asyncio.run(remote.shutdown(timeout_s=1))


async def _all(engine: AsyncEngine) -> list:
    async def one(inputs, parameters):
        request = await validated(engine, GenerateRequest(inputs, GenerateParameters(**parameters)))
        return await engine.generate(request)

    return await asyncio.gather(*(one(inputs, parameters) for inputs, parameters in REQUESTS))


def test_the_core_process_generates_what_the_engine_in_process_does(engines):
    local, remote = engines
    assert dataclasses.replace(remote.info, loaded_at=0) == dataclasses.replace(local.info, loaded_at=0)
    assert remote.tokenizer.encode("café naïve") == local.tokenizer.encode("café naïve")
    steps: list[StepStats] = []
    steps_before = asyncio.run(idle(remote)).num_steps
    remote.observe_steps(steps.append)
    try:
        mine, theirs = asyncio.run(_all(local)), asyncio.run(_all(remote))
    finally:
        remote.observe_steps(None)
    for ours, apart in zip(mine, theirs, strict=True):
        assert apart.generated_text == ours.generated_text
        assert [t.id for t in apart.tokens] == [t.id for t in ours.tokens]
        assert [t.logprob for t in apart.tokens] == pytest.approx([t.logprob for t in ours.tokens], abs=1e-5)
        assert [[t.id for t in top] for top in apart.top_tokens] == [[t.id for t in top] for top in ours.top_tokens]
        assert [t.id for t in apart.prefill_tokens] == [t.id for t in ours.prefill_tokens]
        assert (apart.finish_reason, apart.seed) == (ours.finish_reason, ours.seed)
    assert set(theirs[3].generated_text) <= {"a", "b"} and 3 <= len(theirs[3].generated_text) <= 6
    stats = asyncio.run(idle(remote))
    assert len(steps) == stats.num_steps - steps_before > 0  # metrics see every step the core ran
    generated = sum(len(result.tokens) for result in theirs)
    assert sum(s.num_decode_tokens for s in steps) + len(theirs) == generated  # each first token ends a prefill
    assert stats.num_free_blocks == stats.num_total_blocks


def test_an_aborted_stream_frees_its_blocks_in_the_core(engines):
    _, remote = engines

    async def cut_short() -> int:
        request = await validated(remote, GenerateRequest("a", GenerateParameters(max_new_tokens=200)), stream=True)
        count = 0
        stream = remote.generate_stream(request)
        async for _output in stream:
            count += 1
            if count == 3:
                break
        await stream.aclose()
        return count

    assert asyncio.run(cut_short()) == 3
    stats = asyncio.run(idle(remote))
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_a_grammar_compiling_in_the_core_holds_no_request_sent_after_it(engines):
    """The core compiles a request's grammar again (its own cache); one that takes its whole budget
    there (sent as a spec, as the wire carries it) is answered too complex, and a plain request
    sent just after it finishes first, as an abort of another such request goes ahead of it."""
    _, remote = engines

    async def race() -> list[str]:
        plain = await validated(remote, GenerateRequest("a", GenerateParameters(max_new_tokens=4)))
        hostile = dataclasses.replace(plain, grammar=GrammarSpec("regex", "a{1000000}"))
        aborted = dataclasses.replace(plain, grammar=GrammarSpec("regex", "a{1000000}"))
        order: list[str] = []

        async def run(name: str, request) -> None:
            try:
                await remote.generate(request)
            except GrammarTooComplex:
                name += " too complex"
            order.append(name)

        slow = asyncio.ensure_future(run("hostile", hostile))
        cut = asyncio.ensure_future(run("aborted", aborted))
        await asyncio.sleep(0.05)  # both in the core's hands, compiling
        cut.cancel()
        await run("plain", plain)
        await slow
        return order

    assert asyncio.run(race()) == ["plain", "hostile too complex"]
    stats = asyncio.run(idle(remote))
    assert stats.num_free_blocks == stats.num_total_blocks and (stats.num_running, stats.num_waiting) == (0, 0)


def test_an_error_crosses_the_process_boundary_as_it_is(engines):
    """A request the engine fails (a prompt token past the vocabulary, which validation refuses before
    the engine on the served routes) ends with the same typed error, message and all, on both sides."""

    async def failure(engine: AsyncEngine) -> BaseException:
        request = await validated(engine, GenerateRequest("a", GenerateParameters(max_new_tokens=4)))
        request = dataclasses.replace(request, prompt_token_ids=[engine.info.vocab_size + 5])
        with pytest.raises(InferenceError) as caught:
            await engine.generate(request)
        return caught.value

    local, remote = engines
    mine, theirs = asyncio.run(failure(local)), asyncio.run(failure(remote))
    assert type(theirs) is type(mine) and str(theirs) == str(mine) and theirs.message == mine.message
    stats = asyncio.run(idle(remote))
    assert stats.num_free_blocks == stats.num_total_blocks


def test_started_on_a_loop_the_loop_reads_the_core_and_generates_the_same(engines, tiny_model_dir):
    """The server starts the client on its event loop, which then reads the core's pipe itself (no
    receiver thread): the same results, every step seen by the observer, nothing left behind."""
    local, _ = engines
    config = _config(tiny_model_dir)
    engine = CoreClient.fork(config, start_method="forkserver").wait(config)
    receivers_before = _receiver_threads()

    async def scenario() -> tuple[list, list[StepStats], int, int]:
        engine.start()
        steps: list[StepStats] = []
        engine.observe_steps(steps.append)
        results = await _all(engine)
        stats, receivers = await idle(engine), _receiver_threads()
        await engine.shutdown(timeout_s=1)
        return results, steps, stats.num_steps, receivers

    theirs, steps, num_steps, receivers = asyncio.run(scenario())
    assert receivers == receivers_before  # the loop read the pipe: no receiver thread
    mine = asyncio.run(_all(local))
    for ours, apart in zip(mine, theirs, strict=True):
        assert [t.id for t in apart.tokens] == [t.id for t in ours.tokens]
        assert apart.generated_text == ours.generated_text and apart.finish_reason == ours.finish_reason
    assert len(steps) == num_steps > 0


def _receiver_threads() -> int:
    return sum(thread.name == "core-receiver" for thread in threading.enumerate())


@pytest.mark.parametrize("reader", ["thread", "event loop"])
def test_a_dead_core_ends_every_call_and_refuses_new_ones(tiny_model_dir, reader):
    config = _config(tiny_model_dir)
    engine = CoreClient.fork(config, start_method="forkserver").wait(config)
    if reader == "thread":
        engine.start()

    async def scenario() -> tuple[list, BaseException, str]:
        if reader == "event loop":
            engine.start()
        request = await validated(engine, GenerateRequest("a", GenerateParameters(max_new_tokens=400)), stream=True)
        outcomes: list = []
        first = asyncio.Event()

        async def consume(stream) -> None:
            try:
                async for _output in stream:
                    first.set()
            except Exception as error:  # noqa: BLE001 — what the test checks
                outcomes.append(error)

        tasks = [asyncio.ensure_future(consume(engine.generate_stream(request))) for _ in range(3)]
        await first.wait()
        os.kill(engine.core_pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        reason = await asyncio.wait_for(engine.wait_failed(), 30)
        with pytest.raises(ServerFailed) as refused:
            await engine.generate(request)
        await engine.shutdown(timeout_s=0)
        return outcomes, refused.value, reason

    outcomes, refused, reason = asyncio.run(scenario())
    assert len(outcomes) == 3 and all(isinstance(error, ServerFailed) for error in outcomes), outcomes
    assert all("the engine core process was killed by SIGKILL" in str(error) for error in outcomes)
    assert "killed by SIGKILL" in reason and refused.retryable  # refused before admission: may go elsewhere


def test_lora_and_shards_keep_the_engine_in_the_api_process(tiny_model_dir):
    config = _config(tiny_model_dir)
    assert refusal(config) is None
    with_lora = EngineConfig(model=ModelConfig(model_id=str(tiny_model_dir), max_loras=2))
    assert "LoRA" in (refusal(with_lora) or "")
    sharded = EngineConfig(model=ModelConfig(model_id=str(tiny_model_dir), num_shard=2))
    assert "--num-shard" in (refusal(sharded) or "")


# A process that ran a parallel torch op has libgomp's pool: a plain fork of it would hang at the
# core's first parallel op (the model load), so the core must start from a fork server.
_START = """
import sys, torch
if sys.argv[2] == "after-openmp":
    torch.set_num_threads(2)
    torch.ones(1 << 20).sum()
from inference_service.config import CacheConfig, EngineConfig, ModelConfig
from inference_service.engine.core_client import CoreClient, default_start_method
print(default_start_method(), flush=True)
config = EngineConfig(
    model=ModelConfig(model_id=sys.argv[1], num_threads=2), cache=CacheConfig(block_size=4, max_batch_total_tokens=256)
)
CoreClient.fork(config).wait(config)
print("ready", flush=True)
"""


@pytest.mark.parametrize(("before", "method"), [("nothing", "fork"), ("after-openmp", "forkserver")])
def test_the_core_starts_whether_or_not_openmp_ran_before(tiny_model_dir, before, method):
    result = subprocess.run(
        [sys.executable, "-c", _START, str(tiny_model_dir), before], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [method, "ready"]
