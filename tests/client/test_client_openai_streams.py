"""How the client reads OpenAI-style streams: heartbeats and the gateway's end marker skipped, an
in-band error raised, a stream cut short (a choice without its finish reason, a missing usage
chunk) refused, retries only before the first chunk, headers and deadline sent.

The real server sends heartbeats, end markers and in-band errors only to callers that ask with the
gateway's headers, which these tests send. What it never sends (a stream cut short without an
error) comes from a scripted server, whose errors are the real server's `abort`."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from client_servers import HOST, ScriptedServer, ServerThread, free_port

from inference_service.api.errors import INBAND_ERRORS_KEY, abort
from inference_service.api.keepalive import KEEPALIVE_KEY
from inference_service.errors import UnavailableError as ServerUnavailable
from textgen.v1 import generate_pb2 as pb
from textgen_client import (
    AsyncClient,
    CancelledError,
    Client,
    IncompleteGenerationError,
    RetryPolicy,
    UnavailableError,
    UnknownError,
    ValidationError,
)

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
FAST_RETRY = RetryPolicy(max_retries=3, initial_backoff=0.01, max_backoff=0.05)
PATIENT_RETRY = RetryPolicy(max_retries=100, initial_backoff=0.05, max_backoff=0.25)
# Heartbeats after every 10 µs without output (so between tokens), the end marker, in-band errors.
GATEWAY_HEADERS = {KEEPALIVE_KEY: "0.00001", INBAND_ERRORS_KEY: "1"}
LONG = 400  # greedy, MESSAGES runs to max_tokens on the tiny model


def _by_choice(chunks) -> dict[int, list]:
    """Each choice's chunk pieces in order (the chunks of different choices interleave as they come)."""
    pieces: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            pieces.setdefault(choice.index, []).append(choice)
    return pieces


# -- the real server ------------------------------------------------------------------------------
async def test_heartbeats_and_the_end_marker_are_skipped(chat_server):
    parameters = {"max_tokens": 12, "temperature": 0, "n": 2, "seed": 1, "include_usage": True}
    async with AsyncClient(chat_server.target) as client:
        plain = [c async for c in client.chat_stream(MESSAGES, **parameters)]
        gateway = [c async for c in client.chat_stream(MESSAGES, **parameters, metadata=GATEWAY_HEADERS)]
        events = [e async for e in client.complete_stream("a b", max_tokens=8, temperature=0, metadata=GATEWAY_HEADERS)]
        text = (await client.complete("a b", max_tokens=8, temperature=0)).choices[0].text
    assert _by_choice(gateway) == _by_choice(plain) and len(_by_choice(plain)[1]) > 3
    assert gateway[-1].usage == plain[-1].usage and all(c.id and (c.choices or c.usage) for c in gateway)
    assert all(e.id and e.choices for e in events) and "".join(e.choices[0].text for e in events) == text
    # ... and the server did send them: the same call on a raw stub.
    with grpc.insecure_channel(chat_server.target) as channel:
        stream = channel.unary_stream(
            "/textgen.v1.TextGeneration/ChatCompletionStream",
            request_serializer=pb.ChatCompletionRequest.SerializeToString,
            response_deserializer=pb.ChatCompletionChunk.FromString,
        )
        request = pb.ChatCompletionRequest(messages=[pb.ChatMessage(role="user")], max_tokens=12, temperature=0)
        request.messages[0].content.string_value = MESSAGES[0]["content"]
        raw = list(stream(request, metadata=tuple(GATEWAY_HEADERS.items()), timeout=30))
    assert sum(m.keep_alive for m in raw) >= 1 and [m.done for m in raw][-1] and sum(m.done for m in raw) == 1


async def test_leaving_a_chat_stream_early_cancels_it(chat_server):
    async with AsyncClient(chat_server.target) as client:
        before = chat_server.wait_idle()
        async for chunk in client.chat_stream(MESSAGES, max_tokens=LONG, temperature=0):
            if chunk.choices[0].delta.content:
                break
        # Off the loop: the abandoned stream is closed by the loop (Python's async generator hooks).
        stats = await asyncio.to_thread(chat_server.wait_idle)
        assert (stats.num_running, stats.num_waiting) == (0, 0)
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_steps - before.num_steps < LONG / 2
        reply = await client.chat(MESSAGES, max_tokens=LONG, temperature=0)  # it would have run long
        assert reply.usage.completion_tokens == LONG


async def test_a_stream_waits_for_a_late_server_and_gets_its_shutdown_in_band(tiny_chat_engine_config):
    port = free_port()
    late = ServerThread(tiny_chat_engine_config, port=port)
    starter = threading.Timer(1.0, late.start)
    stopper = threading.Thread(target=late.shutdown, args=(0.0,))
    received = []
    try:
        async with AsyncClient(f"{HOST}:{port}", retry=PATIENT_RETRY, timeout=60) as client:
            starter.start()  # until it serves, the call is refused: retried, no chunk came yet
            with pytest.raises(CancelledError) as caught:
                async for chunk in client.chat_stream(
                    MESSAGES, max_tokens=LONG, temperature=0, metadata={INBAND_ERRORS_KEY: "1"}
                ):
                    received.append(chunk)
                    if len(received) == 3:  # the server goes down while generating
                        stopper.start()
        assert len(received) >= 3 and received[0].choices[0].delta.role == "assistant"
        assert caught.value.error_type == "cancelled" and caught.value.code is None  # an error chunk, no status
    finally:
        starter.join()
        if stopper.is_alive():
            stopper.join()
        late.stop()


# -- a scripted server ----------------------------------------------------------------------------
@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def make(**handlers) -> ScriptedServer:
        servers.append(ScriptedServer(handlers))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def _chunk(index: int, content: str | None = None, finish_reason: str | None = None) -> pb.ChatCompletionChunk:
    choice = pb.ChatCompletionChunkChoice(
        index=index, delta=pb.ChatCompletionDelta(content=content), finish_reason=finish_reason
    )
    return pb.ChatCompletionChunk(id="chatcmpl-1", choices=[choice])


def _usage_chunk() -> pb.ChatCompletionChunk:
    return pb.ChatCompletionChunk(id="chatcmpl-1", usage=pb.Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3))


def _scripted_chat(*chunks: pb.ChatCompletionChunk):
    async def stream(request, context):
        for chunk in chunks:
            yield chunk

    return stream


@pytest.mark.parametrize(
    ("chunks", "parameters", "whole"),
    [
        ([_chunk(0, "a"), _chunk(0, "b", "stop")], {}, True),
        ([_chunk(0, "a")], {}, False),
        ([_chunk(0, "a", "stop"), _chunk(1, "b")], {"n": 2}, False),
        ([_chunk(0, "a", "stop")], {"n": 2}, False),  # choice 1 never started
        ([_chunk(1, "b", "length"), _chunk(0, "a", "stop")], {"n": 2}, True),
        ([_chunk(0, "a", "stop")], {"include_usage": True}, False),
        ([_chunk(0, "a", "stop"), _usage_chunk()], {"include_usage": True}, True),
    ],
)
def test_a_chat_stream_is_whole_once_every_choice_finished(scripted, chunks, parameters, whole):
    server = scripted(ChatCompletionStream=_scripted_chat(*chunks))
    with Client(server.target) as client:
        if whole:
            assert len(list(client.chat_stream(MESSAGES, **parameters))) == len(chunks)
        else:
            with pytest.raises(IncompleteGenerationError):
                list(client.chat_stream(MESSAGES, **parameters))


async def test_a_completion_stream_counts_the_choices_of_every_prompt(scripted):
    async def two_prompts(request, context):
        yield pb.CompletionResponse(choices=[pb.CompletionChoice(index=0, text="x", finish_reason="stop")])
        if request.max_tokens == 2:  # the second prompt's choice too
            yield pb.CompletionResponse(choices=[pb.CompletionChoice(index=1, text="y", finish_reason="stop")])

    server = scripted(CompletionStream=two_prompts)
    async with AsyncClient(server.target) as client:
        events = [e async for e in client.complete_stream(["a", "b"], max_tokens=2)]
        assert [e.choices[0].text for e in events] == ["x", "y"]
        with pytest.raises(IncompleteGenerationError):
            _ = [e async for e in client.complete_stream(["a", "b"], max_tokens=1)]
        assert len([e async for e in client.complete_stream("a", max_tokens=1)]) == 1


@pytest.mark.parametrize(("code", "expected"), [("tool_error", ValidationError), (None, UnknownError)])
async def test_an_inband_error_chunk_raises_its_error(scripted, code, expected):
    error = pb.OpenAIError(message="it broke", type="server_error", code=code)
    server = scripted(
        ChatCompletionStream=_scripted_chat(
            _chunk(0, "a"), pb.ChatCompletionChunk(error=error), pb.ChatCompletionChunk(done=True)
        )
    )
    received = []
    async with AsyncClient(server.target) as client:
        with pytest.raises(expected, match="it broke") as caught:
            async for chunk in client.chat_stream(MESSAGES):
                received.append(chunk)
    assert len(received) == 1 and caught.value.error_type == (code or "internal")


def test_unavailable_is_retried_only_before_the_first_chunk(scripted):
    async def flaky(request, context):
        if len(server.calls) < 3:
            await abort(context, ServerUnavailable("the model is still loading"), "ChatCompletionStream")
        yield _chunk(0, "a")
        if request.max_tokens == 2:
            await abort(context, ServerUnavailable("draining"), "ChatCompletionStream")
        yield _chunk(0, "b", "stop")

    server = scripted(ChatCompletionStream=flaky)
    with Client(server.target, retry=FAST_RETRY) as client:
        assert len(list(client.chat_stream(MESSAGES))) == 2
        assert len(server.calls) == 3
        received = []
        with pytest.raises(UnavailableError, match="draining"):
            for chunk in client.chat_stream(MESSAGES, max_tokens=2):
                received.append(chunk)
    assert len(received) == 1 and len(server.calls) == 4  # no chunk twice


def test_api_key_metadata_and_deadline_reach_the_server(scripted):
    async def echo(request, context):
        yield _chunk(0, f"{context.time_remaining():.3f}", "stop")

    server = scripted(ChatCompletionStream=echo)
    with Client(server.target, api_key="sk-123", metadata={"X-Tenant": "blue"}, timeout=7.0) as client:
        (chunk,) = client.chat_stream(MESSAGES, metadata=[("x-call", "1")], timeout=3.0)
    sent = server.calls[0][1]
    assert sent["authorization"] == "Bearer sk-123" and sent["x-tenant"] == "blue" and sent["x-call"] == "1"
    assert 2.0 < float(chunk.choices[0].delta.content) <= 3.1
