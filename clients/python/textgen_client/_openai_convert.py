"""OpenAI-shaped Python values ⇄ the proto's chat and completion messages.

The proto's JSON names are OpenAI's, so a request is the OpenAI body as a dict, parsed by
protobuf's JSON reader: messages, tools, `tool_choice` and `response_format` are passed exactly as
OpenAI's documentation writes them. A `ChatMessage` of an earlier reply is taken as its dict.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from google.protobuf import json_format

from textgen_client._proto.textgen.v1 import generate_pb2 as pb
from textgen_client.errors import ValidationError
from textgen_client.openai_types import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessage,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCall,
    ModelCard,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)


def build(message_type: type, body: dict[str, Any]) -> Any:
    """The request message of an OpenAI body; `None` values are left out (the server's defaults)."""
    body = {key: value for key, value in body.items() if value is not None}
    try:
        if "logit_bias" in body:
            body["logit_bias"] = {str(token): float(bias) for token, bias in body["logit_bias"].items()}
        if isinstance(body.get("messages"), list):
            body["messages"] = [_message_dict(m) for m in body["messages"]]
        return json_format.ParseDict(body, message_type())
    except (json_format.ParseError, AttributeError, TypeError, ValueError) as error:
        raise ValidationError(f"Input validation error: {error}", "validation") from None


def _message_dict(message: Any) -> Any:
    """A reply's `ChatMessage` as OpenAI's assistant message dict (stream-only fields dropped)."""
    if not isinstance(message, ChatMessage):
        return message
    calls = [{"id": c.id, "type": c.type, "function": dataclasses.asdict(c.function)} for c in message.tool_calls]
    return {"role": message.role, "content": message.content, **({"tool_calls": calls} if calls else {})}


def num_choices(request: pb.ChatCompletionRequest | pb.CompletionRequest) -> int:
    """How many choices the server generates for `request`: `n` for each prompt."""
    n = request.n if request.HasField("n") else 1
    if isinstance(request, pb.CompletionRequest) and request.prompt.HasField("list_value"):
        return n * len(request.prompt.list_value.values)
    return n


def _usage(message: Any) -> Usage | None:
    if not message.HasField("usage"):
        return None
    return Usage(message.usage.prompt_tokens, message.usage.completion_tokens, message.usage.total_tokens)


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def _tool_calls(calls: Any) -> list[ToolCall]:
    return [
        ToolCall(
            id=_optional(c, "id"),
            type=_optional(c, "type"),
            index=_optional(c, "index"),
            function=FunctionCall(_optional(c.function, "name"), _optional(c.function, "arguments")),
        )
        for c in calls
    ]


def _logprobs(choice: Any) -> ChoiceLogprobs | None:
    if not choice.HasField("logprobs"):
        return None
    return ChoiceLogprobs(
        [
            TokenLogprob(
                t.token,
                t.logprob,
                list(t.bytes),
                [TopLogprob(a.token, a.logprob, list(a.bytes)) for a in t.top_logprobs],
            )
            for t in choice.logprobs.content
        ]
    )


def _completion_logprobs(choice: pb.CompletionChoice) -> CompletionLogprobs | None:
    if not choice.HasField("logprobs"):
        return None
    logprobs = choice.logprobs
    # None where the wire has null (the first token of an echoed prompt). A Struct's keys come in no
    # particular order: most likely first, as OpenAI lists them.
    chosen = [json_format.MessageToDict(v) for v in logprobs.token_logprobs]
    top = [
        None if v.HasField("null_value") else dict(sorted(json_format.MessageToDict(v).items(), key=lambda i: -i[1]))
        for v in logprobs.top_logprobs
    ]
    return CompletionLogprobs(list(logprobs.tokens), chosen, top, list(logprobs.text_offset))


def chat_completion(message: pb.ChatCompletionResponse) -> ChatCompletion:
    choices = [
        ChatChoice(
            index=c.index,
            finish_reason=c.finish_reason,
            logprobs=_logprobs(c),
            message=ChatMessage(
                role=c.message.role,
                content=_optional(c.message, "content"),
                tool_calls=_tool_calls(c.message.tool_calls),
            ),
        )
        for c in message.choices
    ]
    return ChatCompletion(
        id=message.id,
        created=message.created,
        model=message.model,
        system_fingerprint=message.system_fingerprint,
        choices=choices,
        usage=_usage(message),
    )


def chat_chunk(message: pb.ChatCompletionChunk) -> ChatCompletionChunk:
    choices = [
        ChatChunkChoice(
            index=c.index,
            logprobs=_logprobs(c),
            finish_reason=_optional(c, "finish_reason"),
            delta=ChatDelta(
                role=_optional(c.delta, "role"),
                content=_optional(c.delta, "content"),
                tool_calls=_tool_calls(c.delta.tool_calls),
            ),
        )
        for c in message.choices
    ]
    return ChatCompletionChunk(
        id=message.id,
        created=message.created,
        model=message.model,
        system_fingerprint=message.system_fingerprint,
        choices=choices,
        usage=_usage(message),
    )


def completion(message: pb.CompletionResponse) -> Completion:
    choices = [
        CompletionChoice(
            index=c.index, text=c.text, finish_reason=_optional(c, "finish_reason"), logprobs=_completion_logprobs(c)
        )
        for c in message.choices
    ]
    return Completion(
        id=message.id,
        created=message.created,
        model=message.model,
        system_fingerprint=message.system_fingerprint,
        choices=choices,
        usage=_usage(message),
    )


def model_card(message: pb.ModelCard) -> ModelCard:
    return ModelCard(id=message.id, object=message.object, created=message.created, owned_by=message.owned_by)
