"""The client's OpenAI-style calls (`chat`, `chat_stream`, `complete`, `complete_stream`) against the
real server on the tiny model with a chat template: typed results, streams that add up to the unary
answer, constrained output, and the server's errors as typed exceptions."""

from __future__ import annotations

import json

import jsonschema
import pytest

from textgen_client import AsyncClient, Client, NotFoundError, ValidationError

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture
def client(chat_server):
    with Client(chat_server.target) as client:
        yield client


def test_chat_returns_typed_choices_and_usage(client):
    reply = client.chat(MESSAGES, max_tokens=8, temperature=0)
    (choice,) = reply.choices
    assert reply.id.startswith("chatcmpl-") and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert 0 < reply.usage.completion_tokens <= 8


def test_seeded_choices_repeat_and_differ(client):
    first = client.chat(MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=3, logprobs=True, top_logprobs=2)
    again = client.chat(MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=3)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]
    assert all(len(t.top_logprobs) == 2 for c in first.choices for t in c.logprobs)


def test_chat_stream_adds_up_to_the_unary_reply(client):
    reply = client.chat(MESSAGES, max_tokens=10, temperature=0)
    chunks = list(client.chat_stream(MESSAGES, max_tokens=10, temperature=0, include_usage=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def test_json_schema_and_a_required_tool(client):
    reply = client.chat(MESSAGES, max_tokens=30, temperature=0,
                        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    reply = client.chat([{"role": "user", "content": "time?"}], max_tokens=80, temperature=0, tools=[TOOL],
                        tool_choice="required", tool_prompt="Tools:")
    (choice,) = reply.choices
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_time" and call.id
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])


def test_complete_and_its_stream(client):
    reply = client.complete(["a b", "c d"], max_tokens=4, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    events = list(client.complete_stream("a b", max_tokens=4, temperature=0))
    assert "".join(c.text for e in events for c in e.choices) == reply.choices[0].text


def test_errors_are_typed(client):
    with pytest.raises(ValidationError) as invalid:
        client.chat(MESSAGES, temperature=-1)
    assert invalid.value.error_type == "validation"
    with pytest.raises(ValidationError) as template:
        client.chat([{"role": "wizard", "content": "x"}])
    assert template.value.error_type == "template_error"
    with pytest.raises(ValidationError) as tool:
        client.chat(MESSAGES, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "missing"}})
    assert tool.value.error_type == "tool_error"
    with pytest.raises(ValidationError):  # not a message list: refused before sending
        client.chat([{"role": "user", "content": "x", "unknown_field": 1}])
    with pytest.raises(ValidationError):
        list(client.chat_stream(MESSAGES, temperature=-1))


def test_not_found_is_its_own_error(chat_server):
    import grpc

    from textgen_client._proto.textgen.v1 import generate_pb2 as pb
    from textgen_client.errors import from_rpc_error

    with grpc.insecure_channel(chat_server.target) as channel:
        get_model = channel.unary_unary("/textgen.v1.TextGeneration/GetModel",
                                        request_serializer=pb.GetModelRequest.SerializeToString,
                                        response_deserializer=pb.ModelCard.FromString)
        with pytest.raises(grpc.RpcError) as missing:
            get_model(pb.GetModelRequest(id="no-such-model"), timeout=10)
    assert isinstance(from_rpc_error(missing.value), NotFoundError)


async def test_the_async_client(chat_server):
    async with AsyncClient(chat_server.target) as client:
        reply = await client.chat(MESSAGES, max_tokens=6, temperature=0)
        chunks = [c async for c in client.chat_stream(MESSAGES, max_tokens=6, temperature=0)]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
