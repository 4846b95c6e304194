"""The client against the real server (tiny random Llama) on loopback: every method, sync and
async, the errors the server really sends, cancellation seen from the server, late servers."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from client_servers import HOST, ServerThread, engine_config, free_port

from textgen_client import (
    AsyncClient,
    CancelledError,
    Client,
    DeadlineExceededError,
    FinishReason,
    Grammar,
    OverloadedError,
    RetryPolicy,
    UnavailableError,
    ValidationError,
)

PROMPT = "the quick brown fox"
# Greedy on the tiny model, this prompt runs to max_new_tokens (no early EOS): a request that
# is not cancelled takes one engine step per token, hundreds of steps (1 s or more on a CPU).
LONG_PROMPT = "birds sing café"
LONG = 400
NO_RETRY = RetryPolicy(max_retries=0)
PATIENT_RETRY = RetryPolicy(max_retries=100, initial_backoff=0.05, max_backoff=0.25)


def _wait_idle(client: Client):
    """Poll the server's Info stats until no request runs and every KV block is free."""
    deadline = time.monotonic() + 30
    while True:
        stats = client.info().stats
        if (
            stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
        ) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


async def _wait_idle_async(client: AsyncClient):
    deadline = time.monotonic() + 30
    while True:
        stats = (await client.info()).stats
        if (
            stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
        ) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


def _assert_idle(stats) -> None:
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks


# -- every method, sync and async -------------------------------------------------------------
def test_generate_and_stream_agree_sync(server):
    with Client(server.target) as client:
        response = client.generate(PROMPT, max_new_tokens=6, decoder_input_details=True, top_n_tokens=2)
        stream = list(client.generate_stream(PROMPT, max_new_tokens=6))
    details = response.details
    assert details.finish_reason in (FinishReason.LENGTH, FinishReason.EOS_TOKEN)
    assert details.generated_tokens == len(details.tokens) == len(stream) <= 6
    assert details.seed is None  # greedy
    assert details.prefill[0].logprob is None and all(t.logprob < 0 for t in details.prefill[1:])
    assert [len(top) for top in details.top_tokens] == [2] * details.generated_tokens
    assert [r.index for r in stream] == list(range(1, len(stream) + 1))
    assert [r.token.id for r in stream] == [t.id for t in details.tokens]
    assert stream[-1].generated_text == response.generated_text
    assert all(r.generated_text is None and r.details is None for r in stream[:-1])
    assert stream[-1].details.generated_tokens == details.generated_tokens
    assert stream[-1].details.input_length == len(details.prefill)


async def test_generate_and_stream_agree_async(server):
    async with AsyncClient(server.target) as client:
        response = await client.generate(PROMPT, max_new_tokens=6, do_sample=True, seed=7)
        stream = [r async for r in client.generate_stream(PROMPT, max_new_tokens=6, do_sample=True, seed=7)]
        again = await client.generate(PROMPT, max_new_tokens=6, do_sample=True, seed=7, details=False)
    assert response.details.seed == 7 and stream[-1].details.seed == 7
    assert [r.token.id for r in stream] == [t.id for t in response.details.tokens]
    assert stream[-1].generated_text == response.generated_text == again.generated_text
    assert again.details is None


async def test_heartbeats_asked_for_are_skipped(server):
    """The REST gateway's header makes the server send heartbeats between tokens; the client,
    asked the same, yields the tokens alone."""
    from inference_service.api.keepalive import KEEPALIVE_KEY

    async with AsyncClient(server.target) as client:
        plain = [r async for r in client.generate_stream(LONG_PROMPT, max_new_tokens=12)]
        beating = [
            r async for r in client.generate_stream(LONG_PROMPT, max_new_tokens=12, metadata={KEEPALIVE_KEY: "0.00001"})
        ]
    assert [(r.index, r.token.id, r.token.text) for r in beating] == [
        (r.index, r.token.id, r.token.text) for r in plain
    ]
    # The second call reuses the first's cached prompt blocks: fewer prefill rows round differently.
    assert [r.token.logprob for r in beating] == pytest.approx([r.token.logprob for r in plain], rel=1e-5)
    assert len(plain) == 12 and beating[-1].generated_text == plain[-1].generated_text


def test_stop_sequences_and_best_of(server):
    with Client(server.target) as client:
        free = client.generate(LONG_PROMPT, max_new_tokens=8).generated_text
        stop = free[2:4]
        stopped = client.generate(LONG_PROMPT, max_new_tokens=8, stop_sequences=[stop])
        best = client.generate(PROMPT, max_new_tokens=4, best_of=2, do_sample=True)
    assert stopped.details.finish_reason is FinishReason.STOP_SEQUENCE
    assert stopped.generated_text.endswith(stop) and free.startswith(stopped.generated_text)
    assert len(best.details.best_of_sequences) == 1


def test_tokenize_info_health_sync(server, tiny_model_dir):
    with Client(server.target) as client:
        tokens = client.tokenize(PROMPT)
        info = client.info()
        assert client.health() is True
    assert "".join(t.text for t in tokens) == PROMPT  # the BOS token has empty text
    assert all(PROMPT[t.start : t.stop] == t.text for t in tokens)
    assert info.model_id == str(tiny_model_dir)
    assert info.max_concurrent_requests == 16 and info.block_size == 4
    assert info.stats.num_total_blocks > 0


async def test_tokenize_info_health_async(server, tiny_model_dir):
    async with AsyncClient(server.target) as client:
        tokens = await client.tokenize(PROMPT)
        info = await client.info()
        assert await client.health() is True
    assert [t.id for t in tokens][1:] and info.model_id == str(tiny_model_dir)
    _assert_idle(info.stats)


# -- errors the server sends --------------------------------------------------------------------
def test_validation_error_sync(server):
    with Client(server.target) as client, pytest.raises(ValidationError) as caught:
        client.generate(PROMPT, top_p=1.0)
    assert caught.value.error_type == "validation"
    assert caught.value.message.startswith("Input validation error: `top_p`")


async def test_validation_error_async(server):
    async with AsyncClient(server.target) as client:
        with pytest.raises(ValidationError, match="top_p"):
            _ = [r async for r in client.generate_stream(PROMPT, top_p=1.0)]
        with pytest.raises(ValidationError, match="max_new_tokens"):
            await client.generate(PROMPT, max_new_tokens=10_000)
        with pytest.raises(ValidationError, match="grammar is not valid"):
            await client.generate(PROMPT, grammar=Grammar(type="regex", value="[0-9"))
        response = await client.generate(PROMPT, max_new_tokens=20, grammar=Grammar(type="regex", value="[0-9]{4}"))
        assert len(response.generated_text) == 4 and response.generated_text.isdigit()


def test_overloaded_sync(busy_server):
    with Client(busy_server.target, retry=NO_RETRY) as client:
        with client.generate_stream(LONG_PROMPT, max_new_tokens=LONG) as first:
            next(first)  # admitted and running: the one slot is taken
            with pytest.raises(OverloadedError) as caught:
                list(client.generate_stream(PROMPT, max_new_tokens=2))
        assert caught.value.error_type == "overloaded" and caught.value.message == "Model is overloaded"
        _assert_idle(_wait_idle(client))


async def test_overloaded_async(busy_server):
    async with AsyncClient(busy_server.target, retry=NO_RETRY) as client:
        first = client.generate_stream(LONG_PROMPT, max_new_tokens=LONG)
        await first.__anext__()
        with pytest.raises(OverloadedError):
            await client.generate(PROMPT, max_new_tokens=2)
        await first.aclose()
        _assert_idle(await _wait_idle_async(client))


def test_deadline_exceeded_sync(server):
    with Client(server.target) as client:
        # The deadline is a quarter of the whole request's time on this machine (a fixed one would be
        # met by a fast enough machine), so a server that stops at it runs far fewer of its steps.
        before = client.info().stats
        started = time.monotonic()
        client.generate(LONG_PROMPT, max_new_tokens=LONG)
        whole_s, whole_steps = time.monotonic() - started, _wait_idle(client).num_steps - before.num_steps
        before = client.info().stats
        with pytest.raises(DeadlineExceededError) as caught:
            client.generate(LONG_PROMPT, max_new_tokens=LONG, timeout=whole_s / 4)
        stats = _wait_idle(client)
    assert caught.value.error_type == "deadline_exceeded"
    _assert_idle(stats)
    assert stats.num_steps - before.num_steps < whole_steps * 3 / 4  # the server stopped at the deadline


async def test_deadline_exceeded_mid_stream_async(server):
    received = []
    async with AsyncClient(server.target) as client:
        before = (await client.info()).stats
        with pytest.raises(DeadlineExceededError):
            async for response in client.generate_stream(LONG_PROMPT, max_new_tokens=LONG, timeout=0.1):
                received.append(response)
        stats = await _wait_idle_async(client)
    assert received  # tokens came before the deadline, and the error was not retried away
    _assert_idle(stats)
    assert stats.num_steps - before.num_steps < LONG / 2


def test_no_server_sync():
    started = time.monotonic()
    with Client(f"{HOST}:{free_port()}", retry=RetryPolicy(max_retries=2, initial_backoff=0.05)) as client:
        with pytest.raises(UnavailableError):
            client.generate(PROMPT)
        assert client.health() is False
    assert time.monotonic() - started < 10


# -- cancellation -------------------------------------------------------------------------------
def test_breaking_out_of_a_stream_cancels_it_sync(server):
    with Client(server.target) as client:
        before = client.info().stats
        for response in client.generate_stream(LONG_PROMPT, max_new_tokens=LONG):
            if response.index == 2:
                break
        stats = _wait_idle(client)
    _assert_idle(stats)
    assert stats.num_steps - before.num_steps < LONG / 2


async def test_breaking_out_of_a_stream_cancels_it_async(server):
    async with AsyncClient(server.target) as client:
        before = (await client.info()).stats
        async for response in client.generate_stream(LONG_PROMPT, max_new_tokens=LONG):
            if response.index == 2:
                break
        stats = await _wait_idle_async(client)
    _assert_idle(stats)
    assert stats.num_steps - before.num_steps < LONG / 2


# -- servers that come and go -------------------------------------------------------------------
def test_a_call_waits_for_a_server_that_starts_late(tiny_model_dir):
    port = free_port()
    late = ServerThread(engine_config(tiny_model_dir), port=port)
    starter = threading.Timer(1.0, late.start)
    try:
        with Client(f"{HOST}:{port}", retry=PATIENT_RETRY, timeout=60) as client:
            started = time.monotonic()
            starter.start()
            response = client.generate(PROMPT, max_new_tokens=3)
            waited = time.monotonic() - started
        assert response.details.generated_tokens >= 1
        assert waited >= 1.0
    finally:
        starter.join()
        late.stop()


async def test_a_stream_waits_for_a_late_server_and_is_cancelled_by_its_shutdown(tiny_model_dir):
    port = free_port()
    late = ServerThread(engine_config(tiny_model_dir), port=port)
    starter = threading.Timer(1.0, late.start)
    stopper = threading.Thread(target=late.shutdown, args=(0.0,))
    received = []
    try:
        async with AsyncClient(f"{HOST}:{port}", retry=PATIENT_RETRY, timeout=60) as client:
            starter.start()
            with pytest.raises(CancelledError) as caught:
                async for response in client.generate_stream(LONG_PROMPT, max_new_tokens=LONG):
                    received.append(response)
                    if response.index == 2:  # the server goes down while generating
                        stopper.start()
        assert len(received) >= 2
        assert caught.value.error_type == "cancelled"
    finally:
        starter.join()
        if stopper.is_alive():
            stopper.join()
        late.stop()
