"""Anthropic's Messages API through the real Envoy, called with the official `anthropic` SDK
unchanged, and over gRPC; answers are checked against OpenAI's chat route on the same conversation
(one chat plan behind both) and against the engine."""

from __future__ import annotations

import dataclasses
import json

import anthropic
import grpc
import jsonschema
import openai
import pytest
from google.protobuf import json_format, struct_pb2

from tests.conftest import GrpcServerThread
from tests.e2e import test_openai_reasoning_tools as reasoning_tools
from tests.scripted_model import write_scripted_model
from tests.tool_schemas import TIME_ZONE_PARAMETERS
from textgen.v1 import anthropic_pb2 as apb
from textgen.v1 import generate_pb2 as pb

SYSTEM = "You are terse."
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
OPENAI_MESSAGES = [{"role": "system", "content": SYSTEM}, *MESSAGES]
# Small definitions: the tiny model's context is 512 tokens of a 330-token vocabulary.
WEATHER_TOOL = {
    "name": "get_weather",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Tokyo"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME_TOOL = {
    "name": "get_time",
    "input_schema": TIME_ZONE_PARAMETERS,
}
SHORT_TOOL_PROMPT = {"tool_prompt": "Tools:"}  # TGI's field, sent as the SDK's extra_body
# The SDK no longer has `temperature` (Anthropic's newer models refuse it); the API still takes it.
GREEDY = {"temperature": 0}
SCHEMAS = {"get_weather": WEATHER_TOOL["input_schema"], "get_time": TIME_TOOL["input_schema"]}


@pytest.fixture(scope="module")
def chat_gateway(tiny_chat_grpc_server, start_gateway):
    return start_gateway(tiny_chat_grpc_server)


@pytest.fixture(scope="module")
def client(chat_gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=chat_gateway.url, api_key="unused", max_retries=0, timeout=60)


def sse_events(raw: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a raw stream."""
    events = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_create_equals_openai_chat_on_the_same_conversation(client, chat_gateway):
    message = client.messages.create(
        model="any-name", system=SYSTEM, messages=MESSAGES, max_tokens=12, extra_body=GREEDY
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.model == chat_gateway.server.server.engine.info.model_id
    chat = openai.OpenAI(base_url=chat_gateway.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model="m", messages=OPENAI_MESSAGES, max_tokens=12, extra_body=GREEDY
    )
    expected = chat.choices[0].message.content
    assert "".join(block.text for block in message.content) == expected
    assert all(block.type == "text" for block in message.content)
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_sequence is None
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens


def test_system_as_text_blocks_and_count_tokens(client):
    blocks = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    as_blocks = client.messages.create(model="m", system=blocks, messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    as_string = client.messages.create(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    assert as_blocks.content == as_string.content
    # `thinking` is accepted and sets the template's switch (this template has none: the same prompt).
    thinking = client.messages.create(
        model="m",
        system=SYSTEM,
        messages=MESSAGES,
        max_tokens=6,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body=GREEDY,
    )
    assert thinking.content == as_string.content and thinking.usage.input_tokens == as_string.usage.input_tokens
    counted = client.messages.count_tokens(model="m", system=SYSTEM, messages=MESSAGES)
    assert counted.input_tokens == as_string.usage.input_tokens
    with_tools = client.messages.count_tokens(
        model="m", system=SYSTEM, messages=MESSAGES, tools=[WEATHER_TOOL], extra_body=SHORT_TOOL_PROMPT
    )
    assert with_tools.input_tokens > counted.input_tokens


def test_stream_text_and_events_in_order(client, chat_gateway):
    whole = client.messages.create(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=10, extra_body=GREEDY)
    with client.messages.stream(
        model="m", system=SYSTEM, messages=MESSAGES, max_tokens=10, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert [b.text for b in final.content] == [b.text for b in whole.content] and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens

    raw = chat_gateway.curl(
        "/v1/messages",
        body={"system": SYSTEM, "messages": MESSAGES, "max_tokens": 10, "temperature": 0, "stream": True},
    )
    events = sse_events(raw)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["stop_sequence"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert all(d["type"] == "text_delta" and d["text"] for d in deltas)
    assert "".join(d["text"] for d in deltas) == whole.content[0].text
    assert events[-2][1]["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_output_config_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model="m",
        messages=MESSAGES,
        max_tokens=30,
        output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_stop_sequences_name_the_one_that_matched(client):
    free = client.messages.create(model="m", messages=MESSAGES, max_tokens=16, extra_body=GREEDY)
    text = free.content[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert len(stop) == 2
    stopped = client.messages.create(
        model="m", messages=MESSAGES, max_tokens=16, stop_sequences=["never-there", stop], extra_body=GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert "".join(b.text for b in stopped.content) == text[: text.index(stop)]
    with client.messages.stream(
        model="m", messages=MESSAGES, max_tokens=16, stop_sequences=[stop], extra_body=GREEDY
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text[: text.index(stop)]
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}], ids=["any", "tool"])
def test_forced_tool_use_then_a_tool_result_turn(client, tool_choice):
    arguments = {
        "model": "m",
        "messages": [{"role": "user", "content": "weather?"}],
        "max_tokens": 80,
        "tools": [WEATHER_TOOL, TIME_TOOL],
        "tool_choice": {**tool_choice, "disable_parallel_tool_use": True},
        "extra_body": {**SHORT_TOOL_PROMPT, **GREEDY},
    }
    message = client.messages.create(**arguments)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    if tool_choice["type"] == "tool":
        assert call.name == "get_weather"
    jsonschema.validate(call.input, SCHEMAS[call.name])

    with client.messages.stream(**arguments) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[0].name == call.name
    assert final.content[0].input == call.input
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert partial and all(partial) and json.loads("".join(partial)) == call.input
    starts = [e for e in events if e.type == "content_block_start"]
    assert len(starts) == 1 and starts[0].content_block.type == "tool_use"

    answer = client.messages.create(
        **{
            **arguments,
            "messages": [
                *arguments["messages"],
                {"role": "assistant", "content": [block.model_dump() for block in message.content]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"},
                        {"type": "text", "text": "and now?"},
                    ],
                },
            ],
            "tool_choice": {"type": "none"},
            "max_tokens": 6,
        }
    )
    assert answer.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in answer.content)


@pytest.mark.parametrize(
    "arguments",
    [
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"role": "system", "content": "hi"}]},
        {"messages": []},
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "wizard"}},
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "missing"}},
        {"tool_choice": {"type": "any"}},
        {"temperature": 1.5},
        {"top_p": 0},
        {"max_tokens": 0},
        {"max_tokens": 100_000},
        {"stop_sequences": ["a", "b", "c", "d", "e"]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"thinking": {"type": "sometimes"}},
        {"tools": [{"name": "web_search", "type": "web_search_20250305"}]},
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_bad_requests_are_4xx_in_anthropics_shape(client, arguments, stream):
    with pytest.raises(anthropic.BadRequestError) as raised:  # the body's fields as given, SDK's or not
        result = client.messages.create(model="m", messages=MESSAGES, max_tokens=4, extra_body=arguments, stream=stream)
        list(result)
    body = raised.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert raised.value.status_code == 400


@pytest.mark.parametrize(
    "body",
    [
        {"messages": MESSAGES},  # no max_tokens
        '{"messages": ',
        {"messages": MESSAGES, "max_tokens": "four"},
    ],
    ids=["no max_tokens", "malformed JSON", "wrong type"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_bad_bodies_are_400_in_anthropics_shape(chat_gateway, body, stream):
    if stream and isinstance(body, dict):
        body = {**body, "stream": True}
    raw = chat_gateway.curl("/v1/messages", "-w", "\n%{http_code}", body=body)
    text, status = raw.rsplit("\n", 1)
    error = json.loads(text)
    assert status == "400" and error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"]


def test_over_grpc(chat_gateway, client):
    stub = chat_gateway.server.stub
    request = apb.MessagesRequest(
        system=struct_pb2.Value(string_value=SYSTEM),
        messages=[apb.AnthropicMessage(role="user", content=struct_pb2.Value(string_value=MESSAGES[0]["content"]))],
        max_tokens=8,
        temperature=0,
    )
    response = stub.Messages(request, timeout=60)
    expected = client.messages.create(model="m", system=SYSTEM, messages=MESSAGES, max_tokens=8, extra_body=GREEDY)
    assert [b.text for b in response.content] == [b.text for b in expected.content]
    assert response.stop_reason == expected.stop_reason and not response.HasField("stop_sequence")
    events = list(stub.MessagesStream(request, timeout=60))
    assert [e.type for e in events[:2]] == ["message_start", "ping"] and events[-1].type == "message_stop"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == expected.content[0].text
    assert stub.CountMessageTokens(request, timeout=60).input_tokens == expected.usage.input_tokens
    with pytest.raises(grpc.RpcError) as refused:
        stub.Messages(apb.MessagesRequest(messages=request.messages), timeout=60)  # no max_tokens
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.MessagesStream(apb.MessagesRequest(messages=request.messages, max_tokens=2, top_k=-1), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_x_api_key(start_grpc_server, start_gateway, tiny_chat_engine_config):
    gateway = start_gateway(start_grpc_server(tiny_chat_engine_config, api_key="sesame"))
    refused = anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as raised:
        refused.messages.create(model="m", messages=MESSAGES, max_tokens=2)
    assert raised.value.body["type"] == "error" and raised.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        refused.messages.count_tokens(model="m", messages=MESSAGES)
    with pytest.raises(anthropic.AuthenticationError):
        list(refused.messages.create(model="m", messages=MESSAGES, max_tokens=2, stream=True))
    ok = anthropic.Anthropic(base_url=gateway.url, api_key="sesame", max_retries=0)
    assert ok.messages.create(model="m", messages=MESSAGES, max_tokens=2).usage.output_tokens >= 1
    assert ok.messages.count_tokens(model="m", messages=MESSAGES).input_tokens > 0
    bearer = anthropic.Anthropic(base_url=gateway.url, auth_token="sesame", max_retries=0)
    assert bearer.messages.create(model="m", messages=MESSAGES, max_tokens=2).content is not None


def test_no_blocks_leak_after_anthropic_calls(chat_gateway, client):
    client.messages.create(model="m", messages=MESSAGES, max_tokens=20)
    with client.messages.stream(model="m", messages=MESSAGES, max_tokens=20) as stream:
        stream.until_done()
    stats = chat_gateway.server.server.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_overloaded_is_429_rate_limit_error_streams_included(start_grpc_server, start_gateway, tiny_chat_engine_config):
    limits = dataclasses.replace(tiny_chat_engine_config.limits, max_concurrent_requests=1)
    server = start_grpc_server(dataclasses.replace(tiny_chat_engine_config, limits=limits))
    gateway = start_gateway(server)
    # The one slot, held by a long TGI stream (the tiny model runs "hello" to its length).
    held = server.stub.GenerateStream(
        pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=480)), timeout=120
    )
    try:
        next(held)
        client = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0, timeout=60)
        with pytest.raises(anthropic.RateLimitError) as refused:
            client.messages.create(model="m", messages=MESSAGES, max_tokens=2)
        assert refused.value.body["error"]["type"] == "rate_limit_error"
        with pytest.raises(anthropic.RateLimitError):
            list(client.messages.create(model="m", messages=MESSAGES, max_tokens=2, stream=True))
    finally:
        held.cancel()
    server.wait_idle(timeout=15)
    assert client.messages.create(model="m", messages=MESSAGES, max_tokens=2).usage.output_tokens >= 1


# -- a reasoning model's thoughts and native tool calls --------------------------------------------
# A Qwen3-like template (reasoning parser qwen3, tool-call parser hermes by default): the tool grammar
# makes the tiny model write a Hermes call.
@pytest.fixture(scope="module")
def thinking_gateway(tiny_engine_config, tmp_path_factory, start_gateway):
    template = tmp_path_factory.mktemp("qwen-like-template") / "chat.jinja"
    template.write_text(reasoning_tools.TEMPLATE)
    model = dataclasses.replace(tiny_engine_config.model, chat_template=str(template))
    server = GrpcServerThread(dataclasses.replace(tiny_engine_config, model=model))
    yield start_gateway(server)
    server.stop(timeout_s=1.0)


@pytest.fixture
def thinking_client(thinking_gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=thinking_gateway.url, api_key="unused", max_retries=0, timeout=60)


def raw_messages_text(gateway, request: dict) -> str:
    """The engine's own text for a Messages request, before any parsing (same plan, same grammar)."""
    server = gateway.server
    parsed = json_format.ParseDict(request, apb.MessagesRequest())
    _, choices = server.call(server.front_end.messages(parsed, stream=False))
    return server.call(server.engine.generate(choices[0])).generated_text


# A DeepSeek-R1-like template: the generation prompt opens the thoughts, so the reply starts inside
# them. A scripted tiny model (tests/scripted_model.py) writes thoughts, `</think>` and an answer, token
# by token (the byte tokenizer splits the marker into seven tokens): nothing in the server is patched.
OPENS_THOUGHTS_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
THOUGHTS, ANSWER = "quick sing", "the brown"


@pytest.fixture(scope="module")
def opened_thoughts_gateway(byte_tokenizer, tiny_engine_config, tmp_path_factory, start_gateway):
    folder = tmp_path_factory.mktemp("opens-thoughts")
    (line_break,) = byte_tokenizer("\n", add_special_tokens=False).input_ids  # the prompt's last token
    write_scripted_model(folder, byte_tokenizer, line_break, f"{THOUGHTS}</think>{ANSWER}", OPENS_THOUGHTS_TEMPLATE)
    model = dataclasses.replace(tiny_engine_config.model, model_id=str(folder))
    server = GrpcServerThread(dataclasses.replace(tiny_engine_config, model=model))
    yield start_gateway(server)
    server.stop(timeout_s=1.0)


def test_thoughts_are_a_thinking_block_unary_and_streamed(opened_thoughts_gateway):
    gateway = opened_thoughts_gateway
    assert gateway.server.front_end.reasoning.name == "qwen3"  # chosen from the template
    raw = raw_messages_text(gateway, {"messages": MESSAGES, "max_tokens": 40, **GREEDY})
    assert raw == f"{THOUGHTS}</think>{ANSWER}"  # the prompt opened the thoughts: the model closes them

    client = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=60)
    arguments = {"model": "m", "messages": MESSAGES, "max_tokens": 40, "extra_body": GREEDY}
    message = client.messages.create(**arguments, thinking={"type": "enabled", "budget_tokens": 1024})
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.signature == "" and text.type == "text"
    assert (thinking.thinking, text.text) == (THOUGHTS, ANSWER) and message.stop_reason == "end_turn"

    with client.messages.stream(**arguments) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text")]
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    thoughts = [d.thinking for d in deltas if d.type == "thinking_delta"]
    assert "".join(thoughts) == THOUGHTS and len(thoughts) > 1  # token by token, the marker held back
    assert "".join(d.text for d in deltas if d.type == "text_delta") == ANSWER
    assert not any("<" in (getattr(d, "thinking", None) or getattr(d, "text", None) or "") for d in deltas)
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[0].thinking == THOUGHTS


def test_hermes_tool_call_is_a_tool_use_block(thinking_gateway, thinking_client):
    arguments = {
        "model": "m",
        "messages": MESSAGES,
        "max_tokens": 80,
        "tools": [TIME_TOOL],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "disabled"},  # the template closes the thoughts: the call comes at once
        "extra_body": GREEDY,
    }
    request = {key: value for key, value in arguments.items() if key not in ("model", "extra_body")}
    raw = raw_messages_text(thinking_gateway, {**request, **GREEDY})
    assert raw.startswith('<tool_call>\n{"name": "get_time", "arguments": ')  # the model wrote Hermes' format

    message = thinking_client.messages.create(**arguments)
    (call,) = message.content
    assert message.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_time"
    jsonschema.validate(call.input, TIME_TOOL["input_schema"])
    assert json.loads(raw.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))["arguments"] == call.input

    with thinking_client.messages.stream(**arguments) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert (
        len(starts) == 1 and starts[0].content_block.type == "tool_use" and starts[0].content_block.name == "get_time"
    )
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert partial and json.loads("".join(partial)) == call.input
    assert final.stop_reason == "tool_use" and final.content[0].input == call.input
