"""Responses requests → chat requests (`frontend.responses`), output items, and the bounded store."""

from __future__ import annotations

import pytest
from google.protobuf import json_format

from inference_service.api import responses as api
from inference_service.errors import NotFoundError, ValidationError
from inference_service.frontend import responses
from inference_service.frontend.openai import chat_plan
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import responses_pb2 as rpb


def _request(**body) -> rpb.CreateResponseRequest:
    return json_format.ParseDict(body, rpb.CreateResponseRequest())


def _messages(chat) -> list[dict]:
    return [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in chat.messages]


def test_string_input_and_instructions_are_system_then_user():
    chat, turn = responses.chat_request(_request(input="hi", instructions="Be terse.", max_output_tokens=5), [])
    assert _messages(chat) == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert turn == [{"role": "user", "content": "hi"}]  # instructions are not carried over
    assert chat.max_completion_tokens == 5 and chat.n == 1


def test_items_become_chat_messages_with_merged_calls():
    items = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    ]
    assert responses.input_messages(items) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
    ]


def test_history_comes_first_and_the_plan_is_chats():
    history = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    request = _request(
        input="three",
        tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        temperature=0,
    )
    chat, turn = responses.chat_request(request, history)
    assert [m["content"] for m in _messages(chat)] == ["one", "two", "three"] and turn[:2] == history
    plan = chat_plan(chat)
    assert plan.tool_calls is not None and list(plan.tool_calls.schemas) == ["f"] and not plan.tool_calls.text_allowed
    assert plan.parameters.grammar is not None and not plan.do_sample


@pytest.mark.parametrize(
    ("body", "mentions"),
    [
        ({}, "`input` is required"),
        ({"input": []}, "must not be empty"),
        ({"input": 1}, "`input` must be"),
        ({"input": [{"type": "computer_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ],
)
def test_bad_requests_say_what_is_wrong(body, mentions):
    with pytest.raises(ValidationError, match=None) as raised:
        responses.chat_request(_request(**body), [])
    assert mentions in raised.value.message


def test_output_items_continue_the_conversation():
    items = [api.function_call_item("c1", "f", "{}"), api.message_item("hello")]
    assert responses.output_messages(items) == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "assistant", "content": "hello"},
    ]
    reasoning = api.reasoning_item("thinking")
    assert reasoning.type == "reasoning" and reasoning.reasoning_content[0].text == "thinking"
    assert responses.output_messages([reasoning]) == []


def test_store_keeps_the_most_recently_used():
    store = api.ResponseStore(capacity=2)
    for name in ("a", "b"):
        store.put(rpb.ResponseObject(id=name), [])
    store.get("a")  # used: "b" is now the oldest
    store.put(rpb.ResponseObject(id="c"), [])
    assert store.get("a").response.id == "a" and store.get("c").response.id == "c"
    with pytest.raises(NotFoundError):
        store.get("b")
    store.delete("a")
    with pytest.raises(NotFoundError):
        store.delete("a")


def _chunk(**delta) -> pb.ChatCompletionChunkChoice:
    return pb.ChatCompletionChunkChoice(index=0, delta=pb.ChatCompletionDelta(**delta))


def test_streamed_thoughts_are_a_reasoning_item_before_the_message():
    events = api._EventStream(rpb.ResponseObject(id="resp_1"))
    sent = [*events.start()]
    for delta in ({"role": "assistant"}, {"reasoning_content": "hm"}, {"reasoning_content": "m"}, {"content": "ok"}):
        sent += events.choice(_chunk(**delta))
    sent += events.finish("stop", api._usage(3, 4))
    assert [e.type for e in sent] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in sent] == list(range(len(sent)))
    reasoning, message = sent[-1].response.output
    assert reasoning.type == "reasoning" and reasoning.reasoning_content[0].text == "hmm"
    assert message.content[0].text == "ok" and sent[-1].response.usage.total_tokens == 7
    assert [e.output_index for e in sent if e.type == "response.output_item.done"] == [0, 1]


def test_thoughts_alone_still_end_with_a_message_and_unary_items_match():
    events = api._EventStream(rpb.ResponseObject(id="resp_1"))
    sent = [*events.choice(_chunk(reasoning_content="hm")), *events.finish("length", api._usage(1, 1))]
    assert [item.type for item in sent[-1].response.output] == ["reasoning", "message"]
    assert sent[-1].response.status == "incomplete"
    message = pb.ChatCompletionMessage(role="assistant", content="ok", reasoning_content="hm")
    assert [item.type for item in api.output_items(message, "stop")] == ["reasoning", "message"]
