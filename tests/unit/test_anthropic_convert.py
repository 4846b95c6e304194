"""Anthropic Messages requests → the chat plan, and engine outputs → Anthropic's blocks and events."""

from __future__ import annotations

import json

import pytest
from google.protobuf import json_format

from inference_service.api import anthropic as anthropic_api
from inference_service.errors import ToolError, ValidationError
from inference_service.frontend import anthropic as anthropic_convert
from inference_service.frontend import reasoning, tool_parsers
from inference_service.outputs import FinishReason, RequestOutput, Token
from textgen.v1 import anthropic_pb2 as apb

TOOL = {"name": "lookup", "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}


def request(**fields) -> apb.MessagesRequest:
    body = {"model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json_format.ParseDict(body, apb.MessagesRequest())


def test_conversation_becomes_openai_messages():
    plan = anthropic_convert.messages_plan(
        request(
            system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            tools=[TOOL],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "find cats"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "s"},
                        {"type": "text", "text": "Looking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "cats"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "3"}]},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "gone", "is_error": True},
                        {"type": "text", "text": "so?"},
                    ],
                },
            ],
        )
    )
    call = {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "cats"}'}}
    assert plan.chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "find cats"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: gone", "tool_call_id": "toolu_2"},
        {"role": "user", "content": "so?"},
    ]
    assert plan.chat.tools == [{"type": "function", "function": {"name": "lookup", "parameters": TOOL["input_schema"]}}]
    assert plan.chat.tool_calls is not None and plan.chat.tool_calls.text_allowed  # auto by default


def test_parameters_map_as_anthropic_means_them():
    plan = anthropic_convert.messages_plan(
        request(max_tokens=5, stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=4)
    )
    parameters = plan.chat.parameters
    assert (parameters.max_new_tokens, parameters.stop, parameters.top_k) == (5, ["END"], 4)
    assert parameters.temperature == 0.5 and parameters.top_p == pytest.approx(0.9) and plan.chat.do_sample
    assert plan.stop_sequences == ["END"]
    assert not anthropic_convert.messages_plan(request(temperature=0)).chat.do_sample
    assert anthropic_convert.messages_plan(request()).chat.parameters.temperature == 1.0


@pytest.mark.parametrize(
    ("choice", "names", "text_allowed", "parallel"),
    [
        ({"type": "auto"}, {"lookup", "other"}, True, True),
        ({"type": "any"}, {"lookup", "other"}, False, True),
        ({"type": "any", "disable_parallel_tool_use": True}, {"lookup", "other"}, False, False),
        ({"type": "tool", "name": "other"}, {"other"}, False, False),
    ],
)
def test_tool_choice(choice, names, text_allowed, parallel):
    tools = [TOOL, {**TOOL, "name": "other"}]
    calls = anthropic_convert.messages_plan(request(tools=tools, tool_choice=choice)).chat.tool_calls
    assert calls is not None and set(calls.schemas) == names
    assert (calls.text_allowed, calls.parallel) == (text_allowed, parallel)
    none = anthropic_convert.messages_plan(request(tools=tools, tool_choice={"type": "none"})).chat
    assert none.tool_calls is None and none.tools == []


def test_thinking_and_output_format():
    enabled = anthropic_convert.messages_plan(request(thinking={"type": "enabled", "budget_tokens": 1024}))
    assert enabled.thinking and enabled.chat.template_variables == {"enable_thinking": True}
    disabled = anthropic_convert.messages_plan(request(thinking={"type": "disabled"}, chat_template_kwargs={"x": 1}))
    assert not disabled.thinking and disabled.chat.template_variables == {"x": 1, "enable_thinking": False}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    shaped = anthropic_convert.messages_plan(
        request(output_config={"format": {"type": "json_schema", "schema": schema}})
    )
    assert shaped.chat.parameters.grammar == {"type": "json", "value": schema}


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"max_tokens": None}, ValidationError, "max_tokens"),
        ({"messages": []}, ValidationError, "must not be empty"),
        ({"messages": [{"role": "system", "content": "x"}]}, ValidationError, "user or assistant"),
        ({"messages": [{"role": "user", "content": 3}]}, ValidationError, "string or a list"),
        ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, ValidationError, "'image'"),
        ({"system": [{"type": "image"}]}, ValidationError, "text blocks"),
        ({"temperature": 1.5}, ValidationError, "temperature"),
        ({"tool_choice": {"type": "maybe"}}, ToolError, "auto, any, tool or none"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, ToolError, "name"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, ToolError, "no defined function"),
        ({"tools": [{"name": "s", "type": "web_search_20250305"}]}, ToolError, "server tools"),
        ({"thinking": {"type": "maybe"}}, ValidationError, "thinking.type"),
        ({"output_config": {"format": {"type": "regex"}}}, ValidationError, "json_schema"),
    ],
)
def test_bad_requests_are_typed_errors(fields, error, message):
    body = {key: value for key, value in fields.items() if value is not None}
    built = request(**body)
    if "max_tokens" in fields:
        built.ClearField("max_tokens")
    with pytest.raises(error, match=message):
        anthropic_convert.messages_plan(built)


def test_count_tokens_needs_no_max_tokens():
    built = request()
    built.ClearField("max_tokens")
    assert anthropic_convert.messages_plan(built, count_only=True).chat.parameters.max_new_tokens is None


# -- results --------------------------------------------------------------------------------------
def outputs(pieces: list[str], reason: FinishReason, generated_text: str) -> list[RequestOutput]:
    """One output per piece; the last one finished with `generated_text` (stop stripped)."""
    made = [RequestOutput("r", tokens=[Token(i, piece, -0.1, False)]) for i, piece in enumerate(pieces)]
    made[-1].finish_reason, made[-1].generated_text = reason, generated_text
    made[-1].num_prompt_tokens, made[-1].num_generated_tokens = 7, len(pieces)
    return made


def events_of(plan, pieces, reason, generated_text) -> list[apb.MessagesStreamEvent]:
    reader = anthropic_api.MessageEvents(plan)
    return [event for output in outputs(pieces, reason, generated_text) for event in reader.read(output)]


def test_text_stream_events_and_the_stop_sequence_that_matched():
    plan = anthropic_convert.messages_plan(request(stop_sequences=["xx", "EN"]))
    # The engine holds a token back while it may start a stop sequence; the matching one ends at it.
    events = events_of(plan, ["Hel", "lo ", "EN"], FinishReason.STOP_SEQUENCE, "Hello ")
    assert [e.type for e in events] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "Hello "
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", "EN")
    assert (events[-2].usage.input_tokens, events[-2].usage.output_tokens) == (7, 3)


def test_tool_call_streams_as_input_json_deltas_across_chunk_boundaries():
    plan = anthropic_convert.messages_plan(request(tools=[TOOL], tool_choice={"type": "any"}))
    text = '{"name": "lookup", "arguments": {"q": "cats"}}'
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]  # cuts through the name and the wrapper
    events = events_of(plan, pieces, FinishReason.EOS_TOKEN, text)
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.name == "lookup"
    assert start.content_block.id.startswith("toolu_") and start.content_block.HasField("input")
    partial = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert all(partial) and json.loads("".join(partial)) == {"q": "cats"}
    assert events[-2].delta.stop_reason == "tool_use" and events[-1].type == "message_stop"


def test_unary_response_blocks_and_stop_reasons():
    from inference_service.outputs import GenerateResult

    plan = anthropic_convert.messages_plan(request(tools=[TOOL]))
    text = '{"name": "lookup", "arguments": {"q": "cats"}}'
    tokens = [Token(1, text, -0.1, False)]
    fields = {
        "num_generated_tokens": 9,
        "num_prompt_tokens": 4,
        "seed": None,
        "tokens": tokens,
        "top_tokens": [],
        "prefill_tokens": [],
    }
    called = anthropic_api.messages_response(
        GenerateResult(generated_text=text, finish_reason=FinishReason.EOS_TOKEN, **fields), plan, "m"
    )
    assert called.stop_reason == "tool_use" and called.content[0].type == "tool_use"
    assert json_format.MessageToDict(called.content[0].input) == {"q": "cats"}
    cut = anthropic_api.messages_response(
        GenerateResult(generated_text="plain", finish_reason=FinishReason.LENGTH, **fields), plan, "m"
    )
    assert cut.stop_reason == "max_tokens" and [b.text for b in cut.content] == ["plain"]
    assert (cut.usage.input_tokens, cut.usage.output_tokens) == (4, 9)


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_thoughts_text_and_a_native_call_stream_as_their_blocks(size):
    plan = anthropic_convert.messages_plan(
        request(tools=[TOOL]), tool_parsers.SYNTAXES["hermes"], reasoning.SYNTAXES["qwen3"]
    )
    text = (
        '<think>\nhmm, cats</think>\n\nLooking.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "c"}}\n</tool_call>'
    )
    pieces = [text[i : i + size] for i in range(0, len(text), size)]  # markers cut across chunks
    events = events_of(plan, pieces, FinishReason.EOS_TOKEN, text)
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["thinking", "text", "tool_use"] and starts[2].name == "lookup"
    assert starts[0].thinking == "" and starts[0].HasField("signature")
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1, 2]
    deltas = [e for e in events if e.type == "content_block_delta"]
    assert {e.index: e.delta.type for e in deltas} == {0: "thinking_delta", 1: "text_delta", 2: "input_json_delta"}
    assert "".join(e.delta.thinking for e in deltas if e.index == 0) == "hmm, cats"
    assert "".join(e.delta.text for e in deltas if e.index == 1).strip() == "Looking."
    assert json.loads("".join(e.delta.partial_json for e in deltas if e.index == 2)) == {"q": "c"}
    assert events[-2].delta.stop_reason == "tool_use"

    from inference_service.outputs import GenerateResult

    fields = {"num_generated_tokens": 9, "num_prompt_tokens": 4, "seed": None, "top_tokens": [], "prefill_tokens": []}
    result = GenerateResult(
        generated_text=text, finish_reason=FinishReason.EOS_TOKEN, tokens=[Token(1, text, -0.1, False)], **fields
    )
    unary = anthropic_api.messages_response(result, plan, "m")
    thinking, said, call = unary.content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", "hmm, cats", "")
    assert (said.type, said.text) == ("text", "Looking.") and call.type == "tool_use" and call.name == "lookup"
    assert json_format.MessageToDict(call.input) == {"q": "c"} and unary.stop_reason == "tool_use"
    # Thoughts cut short by the length limit are still thoughts: a thinking block alone.
    cut = anthropic_api.messages_response(
        GenerateResult(generated_text="<think>hm", finish_reason=FinishReason.LENGTH, tokens=[], **fields), plan, "m"
    )
    assert [(b.type, b.thinking) for b in cut.content] == [("thinking", "hm")] and cut.stop_reason == "max_tokens"
