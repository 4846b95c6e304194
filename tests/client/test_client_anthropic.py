"""The client's Anthropic-style calls (`messages`, `messages_stream`, `count_message_tokens`)
against the real server on the tiny model with a ChatML template: typed replies, streams that add
up to the unary reply, a forced tool call, and the server's refusals as typed exceptions."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.tool_schemas import TIME_ZONE_PARAMETERS
from textgen_client import AsyncClient, Client, ValidationError

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
TOOL = {
    "name": "get_time",
    "input_schema": TIME_ZONE_PARAMETERS,
}


@pytest.fixture
async def client(chat_server):
    async with AsyncClient(chat_server.target) as client:
        yield client


async def test_messages_reply_and_stream_add_up(client):
    reply = await client.messages(MESSAGES, max_tokens=8, temperature=0, system="Be terse.")
    assert reply.id.startswith("msg_") and reply.role == "assistant" and reply.model == (await client.info()).model_id
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert [b.type for b in reply.content] == ["text"] and reply.usage.output_tokens >= 1
    events = [e async for e in client.messages_stream(MESSAGES, max_tokens=8, temperature=0, system="Be terse.")]
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens == reply.usage.input_tokens
    assert [e.type for e in events[-2:]] == ["message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == reply.content[0].text
    assert events[-2].delta.stop_reason == reply.stop_reason
    counted = await client.count_message_tokens(MESSAGES, system="Be terse.")
    assert counted == reply.usage.input_tokens


async def test_a_forced_tool_use(client):
    reply = await client.messages(
        [{"role": "user", "content": "time?"}],
        max_tokens=60,
        temperature=0,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_time"},
        extra={"tool_prompt": "Tools:"},
    )
    (call,) = reply.content
    assert reply.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_time"
    jsonschema.validate(call.input, TOOL["input_schema"])
    events = [
        e
        async for e in client.messages_stream(
            [{"role": "user", "content": "time?"}],
            max_tokens=60,
            temperature=0,
            tools=[TOOL],
            tool_choice={"type": "any"},
            extra={"tool_prompt": "Tools:"},
        )
    ]
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    jsonschema.validate(json.loads(partial), TOOL["input_schema"])


async def test_refusals_are_typed(client):
    with pytest.raises(ValidationError, match="role"):
        await client.messages([{"role": "wizard", "content": "hi"}], max_tokens=2)
    with pytest.raises(ValidationError, match="tool_choice"):
        await client.messages(MESSAGES, max_tokens=2, tools=[TOOL], tool_choice={"type": "maybe"})


def test_blocking_client(chat_server):
    with Client(chat_server.target) as client:
        reply = client.messages(MESSAGES, max_tokens=4, temperature=0)
        streamed = list(client.messages_stream(MESSAGES, max_tokens=4, temperature=0))
        assert "".join(e.delta.text for e in streamed if e.type == "content_block_delta") == reply.content[0].text
        assert client.count_message_tokens(MESSAGES) == reply.usage.input_tokens
