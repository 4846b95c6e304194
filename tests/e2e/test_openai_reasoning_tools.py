"""Reasoning and native tool calls on real generations, through the real Envoy with the official
`openai` SDK: a grammar (or a logit bias) makes the tiny model write `<think>…</think>` or Hermes'
`<tool_call>…</tool_call>` token by token (the byte tokenizer splits every marker across tokens), and
the answers are split as the engine's own raw text says, unary and streamed alike."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest

from tests.conftest import GrpcServerThread
from tests.tool_schemas import TIME_ZONE_PARAMETERS
from textgen.v1 import generate_pb2 as pb

# A Qwen3-like ChatML template: it renders `tools` itself, mentions <tool_call> (so --tool-call-parser
# defaults to hermes) and <think> (so --reasoning-parser defaults to qwen3), and honours enable_thinking.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nCall tools in <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
THINK_THEN_ANSWER = "<think>[a-z]{2,6}( [a-z]{2,6}){2,4}</think>\n[a-z]{2,6}( [a-z]{2,6}){0,2}"
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": TIME_ZONE_PARAMETERS,
    },
}


@pytest.fixture(scope="module")
def thinking_server(tiny_engine_config, tmp_path_factory):
    template = tmp_path_factory.mktemp("qwen-like-template") / "chat.jinja"
    template.write_text(TEMPLATE)
    config = dataclasses.replace(
        tiny_engine_config, model=dataclasses.replace(tiny_engine_config.model, chat_template=str(template))
    )
    server = GrpcServerThread(config)
    yield server
    server.stop(timeout_s=1.0)


@pytest.fixture(scope="module")
def client(thinking_server, start_gateway) -> openai.OpenAI:
    gateway = start_gateway(thinking_server)
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def raw_text(server, request: pb.ChatCompletionRequest) -> str:
    """The engine's own text for a chat request, before any parsing (same plan, same grammar)."""
    _, choices = server.call(server.front_end.chat(request, stream=False))
    return server.call(server.engine.generate(choices[0])).generated_text


def chat_request(**fields) -> pb.ChatCompletionRequest:
    from google.protobuf import json_format

    return json_format.ParseDict({"messages": MESSAGES, **fields}, pb.ChatCompletionRequest())


def chunks_of(stream) -> list:
    chunks = list(stream)
    for chunk in chunks:  # no empty deltas: every chunk says something
        if chunk.choices:
            delta = chunk.choices[0].delta
            said = [delta.role, delta.content, delta.tool_calls, getattr(delta, "reasoning_content", None)]
            assert any(said) or chunk.choices[0].finish_reason, chunk
    return chunks


def test_defaults_follow_the_template(thinking_server):
    assert thinking_server.front_end.reasoning.name == "qwen3"
    assert thinking_server.front_end.tool_syntax.name == "hermes"


def test_thoughts_are_split_from_the_answer_unary_and_streamed(client, thinking_server):
    response_format = {"type": "regex", "value": THINK_THEN_ANSWER}  # TGI's grammar shape
    arguments = {"messages": MESSAGES, "model": "m", "temperature": 0, "max_tokens": 80}
    raw = raw_text(thinking_server, chat_request(response_format=response_format, temperature=0, max_tokens=80))
    assert re.fullmatch(THINK_THEN_ANSWER, raw)

    reply = client.chat.completions.create(**arguments, response_format=response_format)
    message = reply.choices[0].message
    thoughts, answer = message.reasoning_content, message.content
    assert raw == f"<think>{thoughts}</think>\n{answer}"
    assert message.reasoning == thoughts and thoughts and answer
    assert reply.choices[0].finish_reason == "stop"

    chunks = chunks_of(client.chat.completions.create(**arguments, response_format=response_format, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_thoughts = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]
    assert "".join(streamed_thoughts) == thoughts and len(streamed_thoughts) > 1  # token by token
    assert all(d.reasoning == d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None))
    assert "".join(d.content or "" for d in deltas) == answer
    assert not any("<" in (d.content or "") or "<" in (getattr(d, "reasoning_content", None) or "") for d in deltas)


def test_chat_template_kwargs_reach_the_template(client):
    base = {"messages": MESSAGES, "model": "m", "temperature": 0, "max_tokens": 1}
    thinking = client.chat.completions.create(**base)
    not_thinking = client.chat.completions.create(
        **base, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    assert not_thinking.usage.prompt_tokens > thinking.usage.prompt_tokens  # the empty <think></think> was rendered


def test_a_structured_answer_after_free_thoughts(client, thinking_server):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    base = {"messages": MESSAGES, "model": "m", "temperature": 0, "max_tokens": 60, "response_format": response_format}
    lt = thinking_server.front_end.tokenizer.convert_tokens_to_ids("<")
    direct = client.chat.completions.create(**base, logit_bias={str(lt): -100})  # no `<`: no thoughts
    assert (
        direct.choices[0].finish_reason == "stop"
        and getattr(direct.choices[0].message, "reasoning_content", None) is None
    )
    jsonschema.validate(json.loads(direct.choices[0].message.content), schema)
    # Unbiased, the tiny model opens its thoughts (free text) and never closes them: all thought.
    thinking = client.chat.completions.create(**base)
    assert thinking.choices[0].finish_reason == "length" and thinking.choices[0].message.content is None
    assert thinking.choices[0].message.reasoning_content


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_hermes_tool_calls_unary_and_streamed(client, thinking_server, tool_choice):
    lt = thinking_server.front_end.tokenizer.convert_tokens_to_ids("<")
    # auto: a leading `<` can only open a call (text may not start with one, and the thoughts were
    # closed in the prompt by enable_thinking=false), so the bias makes the model call
    extra = {"chat_template_kwargs": {"enable_thinking": False}}
    arguments = {
        "messages": MESSAGES,
        "model": "m",
        "temperature": 0,
        "max_tokens": 80,
        "tools": [TIME_TOOL],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "logit_bias": {str(lt): 100} if tool_choice == "auto" else {},
    }
    request = chat_request(
        tools=[TIME_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
        logit_bias=arguments["logit_bias"],
        chat_template_kwargs=extra["chat_template_kwargs"],
    )
    raw = raw_text(thinking_server, request)
    assert raw.startswith('<tool_call>\n{"name": "get_time", "arguments": ')  # the model wrote Hermes' format

    reply = client.chat.completions.create(**arguments, extra_body=extra)
    choice = reply.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert call.function.name == "get_time" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TIME_TOOL["function"]["parameters"])
    assert raw == f'<tool_call>\n{{"name": "get_time", "arguments": {call.function.arguments}}}\n</tool_call>'

    chunks = chunks_of(client.chat.completions.create(**arguments, extra_body=extra, stream=True))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_time" and pieces[0].id and pieces[0].function.arguments == ""
    assert all(p.function.name is None and p.id is None and p.function.arguments for p in pieces[1:])
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


@pytest.mark.parametrize(
    ("parser", "prefix"),
    [
        ("llama3_json", '{"name": "get_time", "parameters": '),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": '),
    ],
)
def test_other_native_formats_over_grpc(tiny_chat_engine_config, start_grpc_server, parser, prefix):
    model = dataclasses.replace(tiny_chat_engine_config.model, tool_call_parser=parser, reasoning_parser="none")
    server = start_grpc_server(dataclasses.replace(tiny_chat_engine_config, model=model))
    request = chat_request(
        tools=[TIME_TOOL], tool_choice="required", temperature=0, max_tokens=80, parallel_tool_calls=False
    )
    raw = raw_text(server, request)
    assert raw.startswith(prefix)
    reply = server.stub.ChatCompletion(request, timeout=60)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and reply.choices[0].finish_reason == "tool_calls"
    assert raw.startswith(prefix + call.function.arguments)
    chunks = list(server.stub.ChatCompletionStream(request, timeout=60))
    pieces = [tc for c in chunks for choice in c.choices for tc in choice.delta.tool_calls]
    assert pieces[0].function.name == "get_time"
    assert "".join(p.function.arguments for p in pieces) == call.function.arguments
