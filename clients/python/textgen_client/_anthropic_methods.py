"""Anthropic-style calls over the typed RPCs: `AsyncClient.messages`, `messages_stream` and
`count_message_tokens` (the blocking `Client` derives its own from these).

Messages, `system`, tools and `tool_choice` are Anthropic's dicts, as its documentation writes them;
results are the frozen dataclasses of `textgen_client.anthropic_types`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from google.protobuf import json_format

from textgen_client import _openai_convert
from textgen_client._proto.textgen.v1 import anthropic_pb2 as apb
from textgen_client._types import Metadata
from textgen_client.anthropic_types import ContentBlock, Delta, Message, MessageStreamEvent, Usage

_CALL_ARGUMENTS = ("self", "extra", "timeout", "metadata")


def _request(arguments: dict[str, Any]) -> apb.MessagesRequest:
    body = {name: value for name, value in arguments.items() if name not in _CALL_ARGUMENTS}
    body.update(arguments.get("extra") or {})
    return _openai_convert.build(apb.MessagesRequest, body)


def _optional(message: Any, name: str) -> Any:
    return getattr(message, name) if message.HasField(name) else None


def _block(block: apb.AnthropicContentBlock) -> ContentBlock:
    return ContentBlock(
        type=block.type,
        text=_optional(block, "text"),
        id=_optional(block, "id"),
        name=_optional(block, "name"),
        input=json_format.MessageToDict(block.input) if block.HasField("input") else None,
        thinking=_optional(block, "thinking"),
    )


def _usage(usage: apb.AnthropicUsage) -> Usage:
    return Usage(input_tokens=usage.input_tokens, output_tokens=usage.output_tokens)


def message(reply: apb.MessagesResponse) -> Message:
    return Message(
        id=reply.id,
        type=reply.type,
        role=reply.role,
        model=reply.model,
        content=[_block(b) for b in reply.content],
        stop_reason=_optional(reply, "stop_reason"),
        stop_sequence=_optional(reply, "stop_sequence"),
        usage=_usage(reply.usage),
    )


def stream_event(event: apb.MessagesStreamEvent) -> MessageStreamEvent:
    delta = event.delta
    return MessageStreamEvent(
        type=event.type,
        message=message(event.message) if event.HasField("message") else None,
        index=_optional(event, "index"),
        content_block=_block(event.content_block) if event.HasField("content_block") else None,
        delta=Delta(**{f.name: v for f, v in delta.ListFields() if f.name != "signature"})
        if event.HasField("delta")
        else None,
        usage=_usage(event.usage) if event.HasField("usage") else None,
    )


class _MessageEnd:
    """A Messages stream is whole at its `message_stop`; pings are skipped."""

    def __init__(self) -> None:
        self.finished = False

    def convert(self, event: apb.MessagesStreamEvent) -> MessageStreamEvent | None:
        if event.type == "ping":
            return None
        self.finished = event.type == "message_stop"
        return stream_event(event)


class AnthropicMethods:
    """The Anthropic-style methods of `AsyncClient` (a mixin: it uses the client's call plumbing)."""

    async def messages(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        max_tokens: int,
        model: str | None = None,
        system: str | list[dict[str, Any]] | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: dict[str, Any] | None = None,
        thinking: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Message:
        """A reply to `messages` (Anthropic's turns: content a string or blocks, `tool_use` and
        `tool_result` blocks included), as Anthropic's Messages API. `tools` are
        `{"name", "description", "input_schema"}`; `tool_choice` `{"type": "auto" | "any" | "none"}`
        or `{"type": "tool", "name": ...}`. `temperature` is in [0, 1] (0 greedy, absent 1).
        `extra` adds other body fields (`output_config`, `chat_template_kwargs`, `tool_prompt`).

        Raises:
            ValidationError, OverloadedError, DeadlineExceededError, ...: see `textgen_client.errors`.
        """
        request = _request(locals())
        reply = await self._unary("messages", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return message(reply)

    async def messages_stream(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        max_tokens: int,
        model: str | None = None,
        system: str | list[dict[str, Any]] | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: dict[str, Any] | None = None,
        thinking: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[MessageStreamEvent]:
        """`messages`, streamed as Anthropic's events (pings left out): message_start, each
        block's content_block_start, content_block_delta..., content_block_stop, then
        message_delta (stop_reason, usage) and message_stop.

        Raises:
            the errors of `messages`; `IncompleteGenerationError` if the stream ended before
            message_stop.
        """
        request = _request(locals())
        end = _MessageEnd()
        async for event in self._stream("messages_stream", request, timeout, metadata, end):  # type: ignore[attr-defined]
            yield event

    async def count_message_tokens(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        model: str | None = None,
        system: str | list[dict[str, Any]] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: dict[str, Any] | None = None,
        thinking: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> int:
        """The prompt tokens `messages` would take (Anthropic's `count_tokens`): the chat
        template's rendering, tools included."""
        request = _request(locals())
        reply = await self._unary("count_message_tokens", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return reply.input_tokens
