"""OpenAI's Responses API through the real Envoy, called with the official `openai` SDK unchanged
(`responses.create`, `responses.stream`, `retrieve`, `delete`), and the same RPCs over gRPC."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
from google.protobuf import json_format

from tests.tool_schemas import TIME_ZONE_PARAMETERS
from textgen.v1 import responses_pb2 as rpb

# The tiny model's context is 512 tokens: small tools and TGI's short tool prompt (an extension).
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
TIME_TOOL = {
    "type": "function",
    "name": "get_time",
    "parameters": TIME_ZONE_PARAMETERS,
}
SHORT_TOOL_PROMPT = {"tool_prompt": "Tools:"}


@pytest.fixture(scope="module")
def gateway(tiny_chat_grpc_server, start_gateway):
    return start_gateway(tiny_chat_grpc_server)


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _chat_text(client, messages, **options) -> tuple[str, str]:
    """The same conversation through chat completions: (text, finish_reason)."""
    response = client.chat.completions.create(model="m", messages=messages, temperature=0, **options)
    return response.choices[0].message.content, response.choices[0].finish_reason


def test_string_input_is_a_user_message_and_answers_as_chat_does(client, gateway):
    response = client.responses.create(
        model="any", input="the quick brown fox", instructions="You are terse.", temperature=0, max_output_tokens=12
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == gateway.server.engine.info.model_id
    assert response.status in ("completed", "incomplete")
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    text, finish = _chat_text(
        client,
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the quick brown fox"}],
        max_tokens=12,
    )
    assert response.output_text == text
    assert (response.status == "incomplete") == (finish == "length")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage.output_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "You are terse." and response.max_output_tokens == 12
    assert response.store is True and response.tool_choice == "auto" and response.text.format.type == "text"


def test_item_input_with_parts_equals_the_string_input(client):
    items = [
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "the quick "}, {"type": "input_text", "text": "brown fox"}],
        }
    ]
    parts = client.responses.create(model="m", input=items, temperature=0, max_output_tokens=8)
    text, _ = _chat_text(
        client,
        [{"role": "user", "content": [{"type": "text", "text": "the quick "}, {"type": "text", "text": "brown fox"}]}],
        max_tokens=8,
    )
    assert parts.output_text == text


def test_stream_events_in_order_and_the_text_is_the_deltas(client):
    with client.responses.stream(model="m", input="the quick brown fox", temperature=0, max_output_tokens=10) as stream:
        events = list(stream)
    final = events[-1].response  # get_final_response() is for `response.completed` only, as OpenAI's
    if events[-1].type == "response.completed":
        assert stream.get_final_response().output_text == final.output_text
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    body = types[2:-1]
    assert body[:2] == ["response.output_item.added", "response.content_part.added"]
    assert body[-3:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(body[2:-3]) <= {"response.output_text.delta"}
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas == final.output_text
    assert events[-1].response.id == events[0].response.id == final.id
    unary = client.responses.create(model="m", input="the quick brown fox", temperature=0, max_output_tokens=10)
    assert unary.output_text == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text  # streams are stored too


def test_raw_sse_names_each_event(gateway):
    body = {"model": "m", "input": "hi", "stream": True, "temperature": 0, "max_output_tokens": 3}
    raw = gateway.curl("/v1/responses", "-i", body=body)
    head, _, text = raw.replace("\r\n", "\n").partition("\n\n")
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert len(blocks) >= 7
    for block in blocks:
        event_line, data_line = block.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line.removeprefix("data: "))["type"]
    assert "[DONE]" not in text


def test_raw_json_items_carry_only_their_fields(gateway):
    body = {"model": "m", "input": "weather?", "tools": [WEATHER_TOOL], "tool_choice": "required", **SHORT_TOOL_PROMPT}
    response = json.loads(gateway.curl("/v1/responses", body={**body, "temperature": 0, "max_output_tokens": 80}))
    (call,) = response["output"]
    assert set(call) == {"type", "id", "status", "call_id", "name", "arguments"}
    assert response["tools"][0]["name"] == "get_weather" and response["tool_choice"] == "required"
    codex_like = {"input": "hi", "text": {"verbosity": "low"}, "prompt_cache_key": "k", "reasoning": {"effort": "low"}}
    response = json.loads(gateway.curl("/v1/responses", body={**codex_like, "temperature": 0, "max_output_tokens": 3}))
    (message,) = response["output"]
    assert set(message) == {"type", "id", "status", "role", "content"}
    assert set(message["content"][0]) == {"type", "text", "annotations"} and response["metadata"] == {}


def test_two_turns_through_previous_response_id(client):
    first = client.responses.create(
        model="m", input="the quick brown fox", instructions="Be terse.", temperature=0, max_output_tokens=6
    )
    second = client.responses.create(
        model="m", input="and then?", previous_response_id=first.id, temperature=0, max_output_tokens=6
    )
    assert second.previous_response_id == first.id
    # The same conversation in chat: the earlier turn and its answer, instructions not carried over.
    text, _ = _chat_text(
        client,
        [
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "and then?"},
        ],
        max_tokens=6,
    )
    assert second.output_text == text


def test_forced_function_call_then_its_output(client):
    response = client.responses.create(
        model="m",
        input="weather?",
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=80,
        extra_body=SHORT_TOOL_PROMPT,
    )
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    assert response.tools[0].name == "get_weather"

    with client.responses.stream(
        model="m",
        input="weather?",
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=80,
        extra_body=SHORT_TOOL_PROMPT,
    ) as stream:
        events = list(stream)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert deltas == done.arguments == call.arguments

    answer = client.responses.create(
        model="m",
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'}],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=6,
        extra_body=SHORT_TOOL_PROMPT,
    )
    assert answer.output[0].type == "message"
    # The same turn, all items given at once instead of through the store.
    items = client.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 21}'},
        ],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=6,
        extra_body=SHORT_TOOL_PROMPT,
    )
    assert items.output_text == answer.output_text


def test_json_schema_text_format_parses(client):
    schema = {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model="m",
        input="a thing",
        temperature=0,
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}},
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema" and response.text.format.name == "thing"


def test_retrieve_and_delete(client):
    response = client.responses.create(model="m", input="hello", temperature=0, max_output_tokens=3)
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as raised:
        client.responses.retrieve(response.id)
    assert raised.value.body["type"] == "invalid_request_error" and response.id in raised.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(response.id)
    unstored = client.responses.create(model="m", input="hello", temperature=0, max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("body", "status", "mentions"),
    [
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "resp_nope"),
        ({"input": [{"type": "image_generation_call", "id": "x"}]}, 400, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, 400, "input[0].content[0]"),
        ({"input": 3}, 400, "`input`"),
        ({}, 400, "`input`"),
        ({"input": "hi", "temperature": 3}, 400, "temperature"),
        (
            {"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}},
            422,
            "tool_choice",
        ),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format.type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
        ({"input": "hi", "tool_choice": {"type": "web_search"}}, 400, "tool_choice"),
    ],
)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_bad_requests_are_4xx_in_openais_shape(gateway, body, status, mentions, stream):
    raw = gateway.curl("/v1/responses", "-w", "\n%{http_code}", body={"model": "m", **body, "stream": stream})
    text, _, code = raw.rpartition("\n")
    assert int(code) == status, raw
    error = json.loads(text)["error"]
    assert mentions in error["message"] and error["type"] == "invalid_request_error" and error["code"]


def test_the_same_calls_over_grpc(tiny_chat_grpc_server, client):
    stub = tiny_chat_grpc_server.stub
    request = rpb.CreateResponseRequest(model="m", temperature=0, max_output_tokens=8)
    request.input.string_value = "the quick brown fox"
    response = stub.CreateResponse(request, timeout=60)
    assert response.output[0].type == "message"
    rest = client.responses.create(model="m", input="the quick brown fox", temperature=0, max_output_tokens=8)
    assert response.output[0].content[0].text == rest.output_text
    events = list(stub.CreateResponseStream(request, timeout=60))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == rest.output_text
    assert stub.GetResponse(rpb.GetResponseRequest(response_id=response.id), timeout=10) == response

    second = rpb.CreateResponseRequest(model="m", temperature=0, max_output_tokens=4, previous_response_id=response.id)
    json_format.ParseDict([{"role": "user", "content": [{"type": "input_text", "text": "more"}]}], second.input)
    assert stub.CreateResponse(second, timeout=60).previous_response_id == response.id

    deleted = stub.DeleteResponse(rpb.DeleteResponseRequest(response_id=response.id), timeout=10)
    assert deleted.deleted and deleted.id == response.id
    with pytest.raises(grpc.RpcError) as raised:
        stub.GetResponse(rpb.GetResponseRequest(response_id=response.id), timeout=10)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    bad = rpb.CreateResponseRequest(model="m")
    json_format.ParseDict([{"type": "nope"}], bad.input)
    with pytest.raises(grpc.RpcError) as raised:
        stub.CreateResponse(bad, timeout=10)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _request_count(gateway) -> float:
    lines = gateway.curl("/metrics").splitlines()
    line = next(text for text in lines if text.startswith("tgi_request_count "))
    return float(line.split()[1])


def test_responses_are_counted_in_the_metrics(client, gateway):
    before = _request_count(gateway)
    client.responses.create(model="m", input="hi", temperature=0, max_output_tokens=2)
    with client.responses.stream(model="m", input="hi", temperature=0, max_output_tokens=2) as stream:
        list(stream)
    assert _request_count(gateway) == before + 2


def test_api_key_guards_the_responses_routes(start_grpc_server, start_gateway, tiny_chat_engine_config):
    gateway = start_gateway(start_grpc_server(tiny_chat_engine_config, api_key="sesame"))
    wrong = openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong", max_retries=0)
    calls = [
        lambda: wrong.responses.create(model="m", input="hi", max_output_tokens=2),
        lambda: list(wrong.responses.create(model="m", input="hi", max_output_tokens=2, stream=True)),
        lambda: wrong.responses.retrieve("resp_x"),
        lambda: wrong.responses.delete("resp_x"),
    ]
    for call in calls:
        with pytest.raises(openai.AuthenticationError) as refused:
            call()
        assert refused.value.body["type"] == "authentication_error"
    ok = openai.OpenAI(base_url=gateway.url + "/v1", api_key="sesame", max_retries=0)
    response = ok.responses.create(model="m", input="hi", max_output_tokens=2)
    assert ok.responses.retrieve(response.id).id == response.id
