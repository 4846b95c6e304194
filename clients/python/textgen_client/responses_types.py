"""The results of `create_response` and `get_response`: OpenAI's response object as a plain frozen
dataclass with OpenAI's field names; `output` items and stream events are OpenAI's JSON as dicts
(`{"type": "message", "content": [{"type": "output_text", "text": ...}]}`,
`{"type": "function_call", "call_id", "name", "arguments"}`, `{"type": "response.output_text.delta", ...}`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Response:
    id: str
    status: str  # "completed" or "incomplete" (cut by max_output_tokens)
    model: str
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    previous_response_id: str | None = None

    @property
    def output_text(self) -> str:
        """The text of every message item, joined (OpenAI's SDK's `output_text`)."""
        return "".join(
            part.get("text", "")
            for item in self.output
            if item.get("type") == "message"
            for part in item.get("content", ())
            if part.get("type") == "output_text"
        )
