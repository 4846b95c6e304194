"""The client's OpenAI-style calls (`chat`, `chat_stream`, `complete`, `complete_stream`, `model`)
against the real server on the tiny model with a ChatML template: typed results whose numbers add
up, streams that add up to the unary answer, constrained output and tool calls, and the server's
errors as typed exceptions. Async first; the blocking client's calls are the same code, so it gets
fewer tests."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from tests.tool_schemas import TIME_ZONE_PARAMETERS
from textgen_client import AsyncClient, Client, NotFoundError, ValidationError
from textgen_client.openai_types import ChatMessage

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]
# The conftest's ChatML template, rendered (the server adds no BOS to a rendered chat prompt).
RENDERED = "<|im_start|>user\nthe quick brown fox<|im_end|>\n<|im_start|>assistant\n"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": TIME_ZONE_PARAMETERS,
    },
}
# A short tool prompt and one call at most: the tiny model's context is 512 tokens.
TOOL_CALL = {"tools": [TOOL], "tool_choice": "required", "tool_prompt": "Tools:", "parallel_tool_calls": False}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}


@pytest.fixture
async def client(chat_server):
    async with AsyncClient(chat_server.target) as client:
        yield client


def _texts(chunks) -> dict[int, str]:
    """Each choice's text, put together from stream chunks or completion events."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
    return texts


def _finish_reasons(chunks) -> dict[int, str]:
    return {c.index: c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason is not None}


# -- chat ------------------------------------------------------------------------------------------
async def test_chat_returns_typed_choices_and_consistent_usage(client):
    reply = await client.chat(MESSAGES, max_tokens=8, temperature=0, logprobs=True)
    (choice,) = reply.choices
    assert reply.id.startswith("chatcmpl-") and reply.model == (await client.info()).model_id
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.tool_calls == []
    assert choice.finish_reason == "length" and choice.message.content  # greedy, this prompt runs long
    usage = reply.usage
    assert usage.completion_tokens == 8 == len(choice.logprobs.content)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    prompt_tokens = [t for t in await client.tokenize(RENDERED) if t.stop > t.start]  # not Tokenize's BOS
    assert usage.prompt_tokens == len(prompt_tokens)


async def test_seeded_choices_repeat_and_choice_i_is_seeded_seed_plus_i(client):
    first = await client.chat(MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=3, logprobs=True, top_logprobs=2)
    again = await client.chat(MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=3)
    alone = await client.chat(MESSAGES, max_tokens=6, temperature=1.0, seed=4)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.message.content for c in again.choices] and texts[0] != texts[1]
    assert texts[1] == alone.choices[0].message.content
    # Both choices count (special tokens, such as the final EOS, have no logprob entry).
    assert 2 * 6 >= first.usage.completion_tokens >= sum(len(c.logprobs.content) for c in first.choices) > 6
    for choice in first.choices:
        for token in choice.logprobs.content:
            assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
            raw = bytes(token.bytes)  # part of a character: its bytes, shown escaped
            assert token.token in (raw.decode(errors="replace"), "".join(f"\\x{byte:02x}" for byte in raw))


async def test_chat_stream_adds_up_to_the_unary_reply(client):
    reply = await client.chat(MESSAGES, max_tokens=10, temperature=0)
    chunks = [c async for c in client.chat_stream(MESSAGES, max_tokens=10, temperature=0, include_usage=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert _texts(chunks) == {0: reply.choices[0].message.content}
    assert _finish_reasons(chunks) == {0: reply.choices[0].finish_reason}
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


async def test_a_stream_of_two_seeded_choices(client):
    reply = await client.chat(MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=11)
    chunks = [c async for c in client.chat_stream(MESSAGES, max_tokens=6, temperature=1.0, n=2, seed=11)]
    assert _texts(chunks) == {c.index: c.message.content for c in reply.choices}
    assert _finish_reasons(chunks) == {0: "length", 1: "length"}


async def test_response_format_json_schema(client):
    reply = await client.chat(
        MESSAGES,
        max_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}},
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


async def test_a_required_tool_call_unary_and_streamed(client):
    messages = [{"role": "user", "content": "time?"}]
    reply = await client.chat(messages, max_tokens=80, temperature=0, **TOOL_CALL)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.index is None
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TOOL["function"]["parameters"])

    chunks = [c async for c in client.chat_stream(messages, max_tokens=80, temperature=0, **TOOL_CALL)]
    pieces = [t for chunk in chunks for c in chunk.choices for t in c.delta.tool_calls]
    assert {p.index for p in pieces} == {0} and pieces[0].id and pieces[0].function.name == "get_time"
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    assert _finish_reasons(chunks) == {0: "tool_calls"} and _texts(chunks) == {0: ""}


async def test_a_reply_and_a_tool_result_go_back_into_the_conversation(client):
    messages = [{"role": "user", "content": "time?"}]
    reply = await client.chat(messages, max_tokens=80, temperature=0, **TOOL_CALL)
    assistant = reply.choices[0].message
    assert isinstance(assistant, ChatMessage)
    (call,) = assistant.tool_calls
    result = {"role": "tool", "tool_call_id": call.id, "content": "12:00"}
    answer = await client.chat([*messages, assistant, result], max_tokens=4, temperature=0)
    assert answer.choices[0].message.tool_calls == [] and answer.choices[0].finish_reason == "length"
    # The reply's message is taken as OpenAI's dict of it; the call is in the prompt.
    as_dict = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
        ],
    }
    same = await client.chat([*messages, as_dict, result], max_tokens=4, temperature=0)
    assert (same.choices, same.usage) == (answer.choices, answer.usage)
    no_call = await client.chat(
        [*messages, {"role": "assistant", "content": None}, result], max_tokens=4, temperature=0
    )
    assert no_call.usage.prompt_tokens < answer.usage.prompt_tokens

    parts = [{"type": "text", "text": "the quick "}, {"type": "text", "text": "brown fox"}]
    as_parts = await client.chat([{"role": "user", "content": parts}], max_tokens=5, temperature=0)
    as_text = await client.chat(MESSAGES, max_tokens=5, temperature=0)
    assert as_parts.choices[0].message == as_text.choices[0].message


# -- completions -----------------------------------------------------------------------------------
async def test_complete_a_list_of_prompts(client):
    prompts = ["a b", "the quick"]
    reply = await client.complete(prompts, max_tokens=4, temperature=0)
    singles = [await client.complete(p, max_tokens=4, temperature=0) for p in prompts]
    assert reply.id.startswith("cmpl-") and [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [s.choices[0].text for s in singles]
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert reply.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles) == 8

    events = [e async for e in client.complete_stream(prompts, max_tokens=4, temperature=0, include_usage=True)]
    assert _texts(events) == {0: reply.choices[0].text, 1: reply.choices[1].text}
    assert _finish_reasons(events) == {0: "length", 1: "length"} and events[-1].usage == reply.usage


async def test_complete_with_logprobs_and_echo(client):
    reply = await client.complete("the quick", max_tokens=5, temperature=0, logprobs=2, echo=True)
    (choice,) = reply.choices
    logprobs = choice.logprobs
    assert choice.text.startswith("the quick") and len(choice.text) > len("the quick")
    # The prompt's tokens first (the BOS the tokenizer added, "the", " ", "quick"), then the 5 generated.
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4 + 5
    assert logprobs.tokens[1:4] == ["the", " ", "quick"] and logprobs.text_offset[:4] == [0, 0, 3, 4]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts the first
    assert logprobs.text_offset[4] == len("the quick") and logprobs.text_offset == sorted(logprobs.text_offset)
    for chosen, top in zip(logprobs.token_logprobs[1:4], logprobs.top_logprobs[1:4], strict=True):
        assert chosen < 0 and 1 <= len(top) <= 2 and list(top.values()) == sorted(top.values(), reverse=True)
    for chosen, top in zip(logprobs.token_logprobs[4:], logprobs.top_logprobs[4:], strict=True):
        assert 1 <= len(top) <= 2 and list(top.values()) == sorted(top.values(), reverse=True)
        assert chosen >= max(top.values()) - 1e-5  # greedy: the most likely token


# -- the model and errors --------------------------------------------------------------------------
async def test_model(client):
    served = (await client.info()).model_id
    card = await client.model()
    assert card.id == served and card.object == "model"
    assert await client.model(served) == card
    with pytest.raises(NotFoundError) as missing:
        await client.model("no-such-model")
    assert missing.value.error_type == "not_found" and missing.value.code == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in missing.value.message


async def test_errors_are_typed(client):
    with pytest.raises(ValidationError) as invalid:
        await client.chat(MESSAGES, temperature=-1)
    assert invalid.value.error_type == "validation" and invalid.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValidationError) as template:
        await client.chat([{"role": "wizard", "content": "x"}])
    assert template.value.error_type == "template_error"
    with pytest.raises(ValidationError) as tool:
        await client.chat(MESSAGES, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "missing"}})
    assert tool.value.error_type == "tool_error"
    with pytest.raises(ValidationError) as local:  # not a message: refused before anything is sent
        await client.chat([{"role": "user", "content": "x", "unknown_field": 1}])
    assert local.value.code is None
    with pytest.raises(ValidationError):
        await client.complete(["a", 1])
    with pytest.raises(ValidationError) as streamed:
        _ = [c async for c in client.chat_stream(MESSAGES, temperature=-1)]
    assert streamed.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ValidationError):
        _ = [e async for e in client.complete_stream("a", n=0)]


# -- the blocking client ---------------------------------------------------------------------------
def test_the_blocking_client(chat_server):
    with Client(chat_server.target) as client:
        reply = client.chat(MESSAGES, max_tokens=6, temperature=0)
        chunks = list(client.chat_stream(MESSAGES, max_tokens=6, temperature=0))
        assert _texts(chunks) == {0: reply.choices[0].message.content}
        completion = client.complete(["a b", "c d"], max_tokens=3, temperature=0)
        events = list(client.complete_stream(["a b", "c d"], max_tokens=3, temperature=0))
        assert _texts(events) == {c.index: c.text for c in completion.choices}
        assert client.model().id == client.info().model_id
        with pytest.raises(NotFoundError):
            client.model("no-such-model")
        with pytest.raises(ValidationError):
            client.chat(MESSAGES, temperature=-1)
        with pytest.raises(ValidationError):
            list(client.chat_stream(MESSAGES, temperature=-1))
