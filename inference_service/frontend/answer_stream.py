"""A chat reply's text as it streams, read the way its plan says: thoughts first (the reasoning
parser), then the answer as content or tool calls (the tool-call parser). Every route that streams
a chat reply (OpenAI's chat completions and Responses, Anthropic's Messages) reads it here, so the
three agree on where thoughts end and calls begin."""

from __future__ import annotations

from dataclasses import dataclass

from inference_service.frontend.openai import ChatPlan
from inference_service.frontend.reasoning import ReasoningStream
from inference_service.frontend.tool_parsers import ToolParser, tool_parser


@dataclass
class AnswerStream:
    reasoning: ReasoningStream | None
    tools: ToolParser | None

    @classmethod
    def for_plan(cls, plan: ChatPlan) -> AnswerStream:
        reasoning = ReasoningStream(plan.reasoning, plan.reasoning_inside) if plan.reasoning is not None else None
        tools = tool_parser(plan.tool_syntax, plan.tool_calls.schemas) if plan.tool_calls is not None else None
        return cls(reasoning, tools)

    @property
    def called(self) -> bool:
        """Whether the answer so far holds a tool call."""
        return self.tools is not None and self.tools.called

    def pieces(self, text: str, finished: bool) -> list[tuple]:
        """Thoughts as ("reasoning", text), the answer as ("content", text) or tool-call items."""
        pieces: list[tuple] = [("content", text)]
        if self.reasoning is not None:
            pieces = self.reasoning.feed(text) + (self.reasoning.finish() if finished else [])
        if self.tools is None:
            return pieces
        items: list[tuple] = []
        for piece in pieces:
            items += self.tools.feed(piece[1]) if piece[0] == "content" else [piece]
        return items + (self.tools.finish() if finished else [])
