"""Anthropic's Messages routes: Messages (unary), MessagesStream (Anthropic's events) and
CountMessageTokens.

The front end turns a request into the chat plan OpenAI's chat route uses; this module turns the
engine's result back into Anthropic's shapes: content blocks (`thinking`, `text`, `tool_use`, in that
order: a reasoning model's thoughts are split off as the chat route splits them, and tool calls are
read in the model's own format), `stop_reason`
("end_turn", "max_tokens", "stop_sequence", "tool_use") with the `stop_sequence` that matched, and
usage. A stream is message_start, ping, each block's start/deltas/stop, message_delta,
message_stop; heartbeats are pings. Errors as `streaming` says (a status before the first event,
else an `error` event for the REST gateway, which writes each event under its SSE `event:` name).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf import struct_pb2

from inference_service.api.backend import Backend
from inference_service.api.errors import unary_errors
from inference_service.api.streaming import engine_events, stream_errors
from inference_service.frontend.answer_stream import AnswerStream
from inference_service.frontend.anthropic import MessagesPlan
from inference_service.frontend.reasoning import split_reasoning
from inference_service.frontend.tool_parsers import parse_tool_calls
from inference_service.outputs import FinishReason, GenerateResult, RequestOutput
from textgen.v1 import anthropic_pb2 as apb

Context = grpc.aio.ServicerContext

# Our error kinds → Anthropic's error types (the gateway maps the same kinds to HTTP statuses).
ERROR_TYPES = {
    "validation": "invalid_request_error",
    "template_error": "invalid_request_error",
    "tool_error": "invalid_request_error",
    "not_found": "not_found_error",
    "unauthorized": "authentication_error",
    "overloaded": "rate_limit_error",
    "unavailable": "overloaded_error",
    "cancelled": "overloaded_error",
}


def error_type(kind: str) -> str:
    return ERROR_TYPES.get(kind, "api_error")


def _message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def _tool_use_id(call_id: str) -> str:
    """Anthropic's `toolu_` ids for the calls the tool grammar made (`call_...`)."""
    return "toolu_" + call_id.removeprefix("call_")


def _raw_text(tokens: Sequence) -> str:
    return "".join(token.text for token in tokens if not token.special)


def stop_reason(
    reason: FinishReason | None, called_tools: bool, raw_text: str, text: str, plan: MessagesPlan
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) as Anthropic's: the stop sequence is the one that starts where
    the returned text (stop stripped) ends in the generated text."""
    if reason == FinishReason.LENGTH:  # even in a call: its input may be cut short
        return "max_tokens", None
    if called_tools:
        return "tool_use", None
    if reason == FinishReason.STOP_SEQUENCE:
        for stop in plan.stop_sequences:
            if raw_text.startswith(stop, len(text)):
                return "stop_sequence", stop
    return "end_turn", None


def _input(arguments: str) -> struct_pb2.Struct:
    parsed = struct_pb2.Struct()
    parsed.update(json.loads(arguments or "{}"))
    return parsed


def _content(text: str, plan: MessagesPlan) -> tuple[list[apb.AnthropicContentBlock], bool]:
    """The reply's blocks (thoughts, text, tool calls) and whether it called tools."""
    chat, blocks = plan.chat, []
    if chat.reasoning is not None:
        thoughts, text = split_reasoning(chat.reasoning, chat.reasoning_inside, text)
        if thoughts:
            blocks.append(apb.AnthropicContentBlock(type="thinking", thinking=thoughts, signature=""))
    calls: list[dict] = []
    if chat.tool_calls is not None:
        content, calls = parse_tool_calls(chat.tool_syntax, text, chat.tool_calls.schemas)
        text = content.strip() if calls else text  # no call: the text as written
    if text:
        blocks.append(apb.AnthropicContentBlock(type="text", text=text))
    blocks += [
        apb.AnthropicContentBlock(
            type="tool_use",
            id=_tool_use_id(call["id"]),
            name=call["function"]["name"],
            input=_input(call["function"]["arguments"]),
        )
        for call in calls
    ]
    return blocks, bool(calls)


def messages_response(result: GenerateResult, plan: MessagesPlan, model: str) -> apb.MessagesResponse:
    content, called = _content(result.generated_text, plan)
    reason, sequence = stop_reason(result.finish_reason, called, _raw_text(result.tokens), result.generated_text, plan)
    return apb.MessagesResponse(
        id=_message_id(),
        type="message",
        role="assistant",
        model=model,
        content=content,
        stop_reason=reason,
        stop_sequence=sequence,
        usage=apb.AnthropicUsage(input_tokens=result.num_prompt_tokens, output_tokens=result.num_generated_tokens),
    )


@dataclass
class MessageEvents:
    """One reply's outputs as Anthropic's content-block events; `finish` closes the message."""

    plan: MessagesPlan
    _answer: AnswerStream = field(init=False)
    _fed: str = ""  # the text given to the blocks so far
    _raw: str = ""  # the generated text, stop sequence included
    _block: str | None = None  # the open block's type
    _index: int = -1
    events: list[apb.MessagesStreamEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._answer = AnswerStream.for_plan(self.plan.chat)

    def read(self, output: RequestOutput) -> list[apb.MessagesStreamEvent]:
        self.events = []
        text = _raw_text(output.tokens)
        self._raw += text
        if output.finished and output.generated_text is not None:  # the stop sequence is not sent
            text = output.generated_text[len(self._fed) :] if output.generated_text.startswith(self._fed) else ""
        self._fed += text
        for item in self._answer.pieces(text, output.finished):
            if item[0] == "reasoning":
                self._thinking(item[1])
            elif item[0] == "content":
                self._text(item[1])
            elif item[0] == "call":
                self._start("tool_use", id=_tool_use_id(item[2]), name=item[3], input=struct_pb2.Struct())
            else:
                self._delta(apb.AnthropicDelta(type="input_json_delta", partial_json=item[2]))
        if output.finish_reason is not None:
            self._finish(output)
        return self.events

    def _thinking(self, text: str) -> None:
        if not text:
            return
        if self._block != "thinking":
            self._start("thinking", thinking="", signature="")
        self._delta(apb.AnthropicDelta(type="thinking_delta", thinking=text))

    def _text(self, text: str) -> None:
        if not text:
            return
        if self._block != "text":
            self._start("text", text="")
        self._delta(apb.AnthropicDelta(type="text_delta", text=text))

    def _start(self, kind: str, **fields) -> None:
        self._stop()
        self._index, self._block = self._index + 1, kind
        block = apb.AnthropicContentBlock(type=kind, **fields)
        self.events.append(apb.MessagesStreamEvent(type="content_block_start", index=self._index, content_block=block))

    def _delta(self, delta: apb.AnthropicDelta) -> None:
        self.events.append(apb.MessagesStreamEvent(type="content_block_delta", index=self._index, delta=delta))

    def _stop(self) -> None:
        if self._block is not None:
            self.events.append(apb.MessagesStreamEvent(type="content_block_stop", index=self._index))
            self._block = None

    def _finish(self, output: RequestOutput) -> None:
        self._stop()
        called = self._answer.called
        reason, sequence = stop_reason(output.finish_reason, called, self._raw, self._fed, self.plan)
        usage = apb.AnthropicUsage(input_tokens=output.num_prompt_tokens, output_tokens=output.num_generated_tokens)
        delta = apb.AnthropicDelta(stop_reason=reason, stop_sequence=sequence)
        self.events.append(apb.MessagesStreamEvent(type="message_delta", delta=delta, usage=usage))
        self.events.append(apb.MessagesStreamEvent(type="message_stop"))


def _error_event(message: str, kind: str) -> apb.MessagesStreamEvent:
    return apb.MessagesStreamEvent(type="error", error=apb.AnthropicError(type=error_type(kind), message=message))


class AnthropicRoutes:
    """Messages, MessagesStream and CountMessageTokens over one `Backend`."""

    def __init__(self, backend: Backend):
        self._backend = backend

    @unary_errors
    async def Messages(self, request: apb.MessagesRequest, context: Context) -> apb.MessagesResponse:
        with self._backend.observer.track("Messages", context) as call:
            engine = self._backend.engine()
            plan, choices = await self._backend.front_end().messages(request, stream=False)
            call.validated(choices[0])
            result = await engine.generate(choices[0])
            call.finished(result)
            return messages_response(result, plan, engine.info.model_id)

    @stream_errors(_error_event, status_before_first=True)
    async def MessagesStream(
        self, request: apb.MessagesRequest, context: Context
    ) -> AsyncIterator[apb.MessagesStreamEvent]:
        with self._backend.observer.track("MessagesStream", context) as call:
            engine = self._backend.engine()
            plan, choices = await self._backend.front_end().messages(request, stream=True)
            call.validated(choices[0])
            start = apb.MessagesResponse(
                id=_message_id(),
                type="message",
                role="assistant",
                model=engine.info.model_id,
                usage=apb.AnthropicUsage(input_tokens=choices[0].num_prompt_tokens),
            )
            reader, started = MessageEvents(plan), False
            async for event in engine_events(engine, choices, context):
                # message_start once the engine took the request: a refusal (overloaded) is a status.
                if not started:
                    started = True
                    yield apb.MessagesStreamEvent(type="message_start", message=start)
                    yield apb.MessagesStreamEvent(type="ping")
                    if event is None:
                        continue
                if event is None:
                    yield apb.MessagesStreamEvent(type="ping")
                    continue
                _, output = event
                call.streamed(output)
                for message in reader.read(output):
                    yield message

    @unary_errors
    async def CountMessageTokens(self, request: apb.MessagesRequest, context: Context) -> apb.MessageTokensCount:
        self._backend.engine()
        return apb.MessageTokensCount(input_tokens=await self._backend.front_end().count_message_tokens(request))
