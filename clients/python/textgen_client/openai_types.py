"""The results of `chat`, `chat_stream`, `complete`, `complete_stream` and `model`: OpenAI's objects
as plain frozen dataclasses, with OpenAI's field names (`choices[0].message.content`,
`choices[0].message.tool_calls[0].function.arguments`, `choices[0].logprobs.content[0].logprob`,
`usage.total_tokens`, ...). A `ChatMessage` of a reply can go back into the next call's `messages`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class TopLogprob:
    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's raw logprob and its most likely alternatives (`top_logprobs`)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


@dataclass(frozen=True)
class ChoiceLogprobs:
    """OpenAI's `logprobs` of a chat choice: one entry per generated token (`content`)."""

    content: list[TokenLogprob]


@dataclass(frozen=True)
class FunctionCall:
    name: str | None
    arguments: str | None
    """The arguments as JSON text, as OpenAI sends them (`json.loads` it); in stream deltas, a piece."""


@dataclass(frozen=True)
class ToolCall:
    id: str | None
    type: str | None
    function: FunctionCall
    index: int | None = None
    """Set in stream deltas only: which call of the message the piece belongs to."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str | None
    """None when the model called tools instead of answering."""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ChatChoice:
    index: int
    message: ChatMessage
    finish_reason: str
    """"stop", "length" or "tool_calls"."""
    logprobs: ChoiceLogprobs | None = None


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage | None


@dataclass(frozen=True)
class ChatDelta:
    role: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ChatChunkChoice:
    index: int
    delta: ChatDelta
    finish_reason: str | None
    """Set on a choice's last chunk only."""
    logprobs: ChoiceLogprobs | None = None


@dataclass(frozen=True)
class ChatCompletionChunk:
    """One event of `chat_stream`: new text (or tool-call pieces) for some choices; the usage-only
    chunk that `include_usage=True` adds last has no choices."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None


@dataclass(frozen=True)
class CompletionLogprobs:
    """OpenAI's (legacy) logprobs of a text completion, one entry per token of `text`."""

    tokens: list[str]
    token_logprobs: list[float | None]
    """None for the first token of a prompt sent back with `echo` (nothing before it predicts it)."""
    top_logprobs: list[dict[str, float] | None]
    """The `logprobs` most likely tokens at each position, token text -> logprob (None as above)."""
    text_offset: list[int]


@dataclass(frozen=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: str | None
    """"stop" or "length"; in `complete_stream`, set on a choice's last event only."""
    logprobs: CompletionLogprobs | None = None
    """Set when `logprobs` was asked for."""


@dataclass(frozen=True)
class Completion:
    """The result of `complete` (or one event of `complete_stream`)."""

    id: str
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None


@dataclass(frozen=True)
class ModelCard:
    """The served model, as OpenAI's `/v1/models/{id}` describes it (the result of `model`)."""

    id: str
    object: str
    created: int
    owned_by: str
