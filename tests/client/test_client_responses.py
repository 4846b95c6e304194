"""The client's Responses-style calls (`create_response`, `create_response_stream`, `get_response`,
`delete_response`) against the real server on the tiny model with a chat template: typed replies,
streams that add up to the unary reply, two turns, a forced function call, and typed refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.tool_schemas import TIME_ZONE_PARAMETERS
from textgen_client import AsyncClient, Client, NotFoundError, ValidationError

TOOL = {
    "type": "function",
    "name": "get_time",
    "parameters": TIME_ZONE_PARAMETERS,
}


@pytest.fixture
async def client(chat_server):
    async with AsyncClient(chat_server.target) as client:
        yield client


async def test_response_and_stream_add_up(client):
    reply = await client.create_response("the quick brown fox", max_output_tokens=8, temperature=0)
    assert reply.id.startswith("resp_") and reply.status in ("completed", "incomplete")
    assert [item["type"] for item in reply.output] == ["message"] and reply.usage["output_tokens"] >= 1
    events = [e async for e in client.create_response_stream("the quick brown fox", max_output_tokens=8, temperature=0)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == f"response.{reply.status}"
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == reply.output_text
    assert (await client.get_response(reply.id)).output_text == reply.output_text


async def test_two_turns_forced_call_and_refusals(client):
    call_reply = await client.create_response(
        "time?",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=100,
        temperature=0,
        extra={"tool_prompt": "Tools:"},
    )
    (call,) = call_reply.output
    assert call["type"] == "function_call" and call["name"] == "get_time"
    jsonschema.validate(json.loads(call["arguments"]), TOOL["parameters"])
    answer = await client.create_response(
        [{"type": "function_call_output", "call_id": call["call_id"], "output": "noon"}],
        previous_response_id=call_reply.id,
        max_output_tokens=4,
        temperature=0,
        extra={"tool_prompt": "Tools:"},
    )
    assert answer.previous_response_id == call_reply.id and answer.output[0]["type"] == "message"
    await client.delete_response(call_reply.id)
    with pytest.raises(NotFoundError):
        await client.get_response(call_reply.id)
    with pytest.raises(NotFoundError):
        await client.create_response("again", previous_response_id=call_reply.id)
    with pytest.raises(ValidationError):
        await client.create_response([{"type": "nope"}])


def test_blocking_client_has_the_calls(chat_server):
    with Client(chat_server.target) as client:
        reply = client.create_response("hi", max_output_tokens=3, temperature=0)
        events = list(client.create_response_stream("hi", max_output_tokens=3, temperature=0))
        assert events[-1]["response"]["output"][0]["content"][0]["text"] == reply.output_text
        client.delete_response(reply.id)
