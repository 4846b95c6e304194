"""The agents' APIs on the demo model (real weights), as agent clients call them: the official
`anthropic` SDK (`messages.create`, `messages.stream`, tools with a tool result, `count_tokens`) and
the official `openai` SDK (`responses.create`, `responses.stream`, two turns through
`previous_response_id`, a function call answered with its output), unchanged, through the real Envoy,
and the same requests over the gRPC stubs. One server serves the module; replies are short and greedy.
"""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from google.protobuf import json_format

from textgen.v1 import anthropic_pb2 as apb
from textgen.v1 import responses_pb2 as rpb

pytestmark = pytest.mark.slow

TIMEOUT = 120
SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
MAX_TOKENS = 8
TOOL_TOKENS = 32  # enough for the call
GREEDY = {"temperature": 0}  # the anthropic SDK has no `temperature` argument any more; the API takes it


@pytest.fixture(scope="module")
def demo_gateway(demo_grpc_server, start_gateway):
    return start_gateway(demo_grpc_server)


@pytest.fixture(scope="module")
def claude(demo_gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=demo_gateway.url, api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def oai(demo_gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=demo_gateway.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


# -- Anthropic's Messages API ------------------------------------------------------------------------
def test_messages_create_stream_count_tokens_and_grpc_agree(claude, demo_gateway):
    arguments = {"model": "claude-any", "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}]}
    message = claude.messages.create(**arguments, max_tokens=MAX_TOKENS, extra_body=GREEDY)
    (block,) = message.content
    assert message.type == "message" and message.role == "assistant" and block.type == "text"
    assert "Paris" in block.text  # the demo model knows this one
    assert message.stop_reason in ("end_turn", "max_tokens") and 0 < message.usage.output_tokens <= MAX_TOKENS

    with claude.messages.stream(**arguments, max_tokens=MAX_TOKENS, extra_body=GREEDY) as stream:
        deltas = [event.delta.text for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == final.content[0].text == block.text and len(deltas) > 1
    assert final.usage.output_tokens == message.usage.output_tokens

    counted = claude.messages.count_tokens(**arguments)
    assert counted.input_tokens == message.usage.input_tokens

    request = json_format.ParseDict({**arguments, "max_tokens": MAX_TOKENS, **GREEDY}, apb.MessagesRequest())
    stub = demo_gateway.server.stub
    assert [b.text for b in stub.Messages(request, timeout=TIMEOUT).content] == [block.text]
    events = list(stub.MessagesStream(request, timeout=TIMEOUT))
    assert [events[0].type, events[-1].type] == ["message_start", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    assert stub.CountMessageTokens(request, timeout=TIMEOUT).input_tokens == counted.input_tokens


def test_messages_tool_use_then_a_tool_result(claude):
    tool = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}
    turn = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = claude.messages.create(
        model="m",
        max_tokens=TOOL_TOKENS,
        messages=turn,
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    (call,) = message.content
    assert message.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 degrees."}
    history = [*turn, {"role": "assistant", "content": [call.model_dump()]}, {"role": "user", "content": [result]}]
    answer = claude.messages.create(model="m", max_tokens=MAX_TOKENS, messages=history, extra_body=GREEDY)
    assert [block.type for block in answer.content] == ["text"] and answer.content[0].text.strip()
    # The call and its result were rendered into the prompt the answer read.
    without_them = claude.messages.count_tokens(model="m", messages=turn).input_tokens
    assert answer.usage.input_tokens > without_them + len("Sunny, 21 degrees.") // 4


# -- OpenAI's Responses API --------------------------------------------------------------------------
def test_responses_create_stream_and_grpc_agree(oai, demo_gateway):
    arguments = {
        "model": "m",
        "input": QUESTION,
        "instructions": SYSTEM,
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = oai.responses.create(**arguments)
    assert response.status in ("completed", "incomplete") and "Paris" in response.output_text
    with oai.responses.stream(**arguments) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert "".join(deltas) == events[-1].response.output_text == response.output_text and len(deltas) > 1

    stub = demo_gateway.server.stub
    over_grpc = stub.CreateResponse(json_format.ParseDict(arguments, rpb.CreateResponseRequest()), timeout=TIMEOUT)
    assert over_grpc.output[0].content[0].text == response.output_text
    stored = stub.GetResponse(rpb.GetResponseRequest(response_id=response.id), timeout=TIMEOUT)
    assert stored.output[0].content[0].text == response.output_text


def test_responses_two_turns_through_previous_response_id(oai):
    first = oai.responses.create(model="m", input="Name a colour.", max_output_tokens=MAX_TOKENS, temperature=0)
    second = oai.responses.create(
        model="m",
        input="Name another one.",
        previous_response_id=first.id,
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output_text.strip()
    # The stored turn is the conversation's start: the same as sending the whole conversation as items.
    explicit = oai.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Name another one."},
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert second.output_text == explicit.output_text
    assert second.usage.input_tokens == explicit.usage.input_tokens > first.usage.input_tokens


def test_responses_function_call_then_its_output_over_http_and_grpc(oai, demo_gateway):
    tool = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER}
    response = oai.responses.create(
        model="m",
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=TOOL_TOKENS,
        temperature=0,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    second_turn = {
        "model": "m",
        "previous_response_id": response.id,
        "input": [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}],
        "max_output_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    answer = oai.responses.create(**second_turn)
    assert [item.type for item in answer.output] == ["message"] and answer.output_text.strip()
    request = json_format.ParseDict(second_turn, rpb.CreateResponseRequest())
    events = list(demo_gateway.server.stub.CreateResponseStream(request, timeout=TIMEOUT))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == answer.output_text
