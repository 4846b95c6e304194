"""OpenAI-shaped Python values ⇄ the proto's chat and completion messages.

The proto's JSON names are OpenAI's, so a request is the OpenAI body as a dict, parsed by
protobuf's JSON reader: messages, tools, `tool_choice` and `response_format` are passed exactly as
OpenAI's documentation writes them.
"""

from __future__ import annotations

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
    Completion,
    CompletionChoice,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)


def build(message_type: type, body: dict[str, Any]) -> Any:
    """The request message of an OpenAI body; `None` values are left out (the server's defaults)."""
    body = {key: value for key, value in body.items() if value is not None}
    if "logit_bias" in body:
        body["logit_bias"] = {str(token): float(bias) for token, bias in body["logit_bias"].items()}
    try:
        return json_format.ParseDict(body, message_type())
    except json_format.ParseError as error:
        raise ValidationError(f"Input validation error: {error}", "validation") from None


def _usage(message: Any) -> Usage | None:
    if not message.HasField("usage"):
        return None
    return Usage(message.usage.prompt_tokens, message.usage.completion_tokens, message.usage.total_tokens)


def _tool_calls(messages: Any) -> list[ToolCall]:
    return [ToolCall(id=c.id if c.HasField("id") else None, type=c.type if c.HasField("type") else None,
                     index=c.index if c.HasField("index") else None,
                     function=FunctionCall(c.function.name if c.function.HasField("name") else None,
                                           c.function.arguments if c.function.HasField("arguments") else None))
            for c in messages]


def _logprobs(choice: Any) -> list[TokenLogprob] | None:
    if not choice.HasField("logprobs"):
        return None
    return [TokenLogprob(t.token, t.logprob, list(t.bytes),
                         [TopLogprob(a.token, a.logprob, list(a.bytes)) for a in t.top_logprobs])
            for t in choice.logprobs.content]


def chat_completion(message: pb.ChatCompletionResponse) -> ChatCompletion:
    choices = [ChatChoice(index=c.index, finish_reason=c.finish_reason, logprobs=_logprobs(c),
                          message=ChatMessage(role=c.message.role,
                                              content=c.message.content if c.message.HasField("content") else None,
                                              tool_calls=_tool_calls(c.message.tool_calls)))
               for c in message.choices]
    return ChatCompletion(id=message.id, created=message.created, model=message.model,
                          system_fingerprint=message.system_fingerprint, choices=choices, usage=_usage(message))


def chat_chunk(message: pb.ChatCompletionChunk) -> ChatCompletionChunk:
    choices = [ChatChunkChoice(index=c.index, logprobs=_logprobs(c),
                               finish_reason=c.finish_reason if c.HasField("finish_reason") else None,
                               delta=ChatDelta(role=c.delta.role if c.delta.HasField("role") else None,
                                               content=c.delta.content if c.delta.HasField("content") else None,
                                               tool_calls=_tool_calls(c.delta.tool_calls)))
               for c in message.choices]
    return ChatCompletionChunk(id=message.id, created=message.created, model=message.model, choices=choices,
                               usage=_usage(message))


def completion(message: pb.CompletionResponse) -> Completion:
    choices = [CompletionChoice(index=c.index, text=c.text,
                                finish_reason=c.finish_reason if c.HasField("finish_reason") else None,
                                logprobs=list(c.logprobs.token_logprobs) if c.HasField("logprobs") else None)
               for c in message.choices]
    return Completion(id=message.id, created=message.created, model=message.model, choices=choices,
                      usage=_usage(message))
