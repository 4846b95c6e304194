"""The results of `messages`, `messages_stream` and `count_message_tokens`: Anthropic's objects as
plain frozen dataclasses, with Anthropic's field names (`content[0].text`, `content[0].input`,
`stop_reason`, `usage.output_tokens`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ContentBlock:
    """`text` (`text`), `tool_use` (`id`, `name`, `input`: the call's arguments as a dict) or
    `thinking` (`thinking`)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    thinking: str | None = None


@dataclass(frozen=True)
class Message:
    """A reply: its blocks, why it stopped ("end_turn", "max_tokens", "stop_sequence",
    "tool_use") and the stop sequence that matched."""

    id: str
    type: str
    role: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


@dataclass(frozen=True)
class Delta:
    """A `content_block_delta`'s piece (`text_delta`: `text`; `input_json_delta`: `partial_json`;
    `thinking_delta`: `thinking`) or a `message_delta`'s `stop_reason` and `stop_sequence`."""

    type: str | None = None
    text: str | None = None
    partial_json: str | None = None
    thinking: str | None = None
    stop_reason: str | None = None
    stop_sequence: str | None = None


@dataclass(frozen=True)
class MessageStreamEvent:
    """One of Anthropic's stream events, by `type`: message_start (`message`), ping,
    content_block_start (`index`, `content_block`), content_block_delta (`index`, `delta`),
    content_block_stop (`index`), message_delta (`delta`, `usage`), message_stop."""

    type: str
    message: Message | None = None
    index: int | None = None
    content_block: ContentBlock | None = None
    delta: Delta | None = None
    usage: Usage | None = field(default=None)
