"""The results of `chat`, `chat_stream`, `complete` and `complete_stream`: OpenAI's objects as plain
frozen dataclasses, with OpenAI's field names (`choices[0].message.content`,
`choices[0].message.tool_calls[0].function.arguments`, `usage.total_tokens`, ...).
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
    logprobs: list[TokenLogprob] | None = None


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
    logprobs: list[TokenLogprob] | None = None


@dataclass(frozen=True)
class ChatCompletionChunk:
    """One event of `chat_stream`: new text (or tool-call pieces) for some choices; the usage-only
    chunk that `include_usage=True` adds last has no choices."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None


@dataclass(frozen=True)
class CompletionChoice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    """The logprob of each token of `text` when `logprobs` was asked for."""


@dataclass(frozen=True)
class Completion:
    """The result of `complete` (or one event of `complete_stream`)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
