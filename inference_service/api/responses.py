"""OpenAI's Responses API: CreateResponse(Stream), GetResponse, DeleteResponse.

A response is a chat completion in other shapes: the request becomes a chat request
(`frontend.responses`), the front end plans and validates it as chat, and the chat result (or the
chat stream's deltas, `ChatChoiceStream`) becomes output items (`message` with `output_text`,
`function_call`) or the typed stream events, numbered by `sequence_number`.

Stored responses (`store`, default true) live in `ResponseStore`: the most recent
`STORED_RESPONSES` of this replica, in memory, each with its conversation so far, which
`previous_response_id` continues. Another replica (or a restart) does not know them: 404.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from inference_service.api import openai_responses
from inference_service.api.backend import Backend
from inference_service.api.errors import unary_errors
from inference_service.api.openai_responses import ChatChoiceStream, ResponseHeader
from inference_service.api.streaming import engine_events, stream_errors
from inference_service.errors import ECHO_CHARS, NotFoundError, quoted, shortened
from inference_service.frontend import responses
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import responses_pb2 as rpb

Context = grpc.aio.ServicerContext
STORED_RESPONSES = 1000
# Error kinds -> OpenAI's error type, for a stream's in-band `error` event (the gateway maps a
# status itself).
_ERROR_TYPES = {"unauthorized": "authentication_error", "overloaded": "rate_limit_error"}
_SERVER_ERRORS = ("generation", "internal", "unavailable", "cancelled")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Stored:
    response: rpb.ResponseObject
    conversation: list[dict[str, Any]]  # chat messages: the turns so far, output included


class ResponseStore:
    """The most recent `capacity` stored responses (least recently used first out)."""

    def __init__(self, capacity: int = STORED_RESPONSES):
        self._capacity = capacity
        self._items: collections.OrderedDict[str, _Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: rpb.ResponseObject, conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response.id] = _Stored(response, conversation)
            self._items.move_to_end(response.id)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str, what: str = "Response") -> _Stored:
        with self._lock:
            found = self._items.get(response_id)
            if found is None:
                given = quoted(shortened(response_id, ECHO_CHARS))
                raise NotFoundError(f"{what} with id {given} not found (responses are kept in this replica's memory).")
            self._items.move_to_end(response_id)
            return found

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        with self._lock:
            self._items.pop(response_id, None)


# -- items -------------------------------------------------------------------------------------------
def message_item(text: str, status: str = "completed", item_id: str | None = None) -> rpb.ResponseOutputItem:
    item = rpb.ResponseOutputItem(type="message", id=item_id or _new_id("msg"), status=status, role="assistant")
    if status != "in_progress":
        item.content.append(rpb.ResponseContentPart(type="output_text", text=text))
    return item


def function_call_item(
    call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None
) -> rpb.ResponseOutputItem:
    return rpb.ResponseOutputItem(
        type="function_call",
        id=item_id or _new_id("fc"),
        status=status,
        call_id=call_id,
        name=name,
        arguments=arguments,
    )


def reasoning_item(text: str | None, status: str = "completed", item_id: str | None = None) -> rpb.ResponseOutputItem:
    """A reasoning model's thoughts (the text of its `<think>…</think>`, split by the reasoning
    parser) as a reasoning item, which comes before the answer's items; no text while in progress."""
    item = rpb.ResponseOutputItem(type="reasoning", id=item_id or _new_id("rs"), status=status)
    if text is not None:
        item.reasoning_content.append(rpb.ResponseReasoningText(type="reasoning_text", text=text))
    return item


def _status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(num_prompt_tokens: int, num_generated_tokens: int) -> rpb.ResponseUsage:
    return rpb.ResponseUsage(
        input_tokens=num_prompt_tokens,
        input_tokens_details=rpb.ResponseInputTokensDetails(cached_tokens=0),
        output_tokens=num_generated_tokens,
        output_tokens_details=rpb.ResponseOutputTokensDetails(reasoning_tokens=0),
        total_tokens=num_prompt_tokens + num_generated_tokens,
    )


def response_object(
    request: rpb.CreateResponseRequest, response_id: str, created_at: int, model: str
) -> rpb.ResponseObject:
    """The response's envelope, in progress and without output: what the request asked, echoed."""
    response = rpb.ResponseObject(
        id=response_id,
        object="response",
        created_at=created_at,
        status="in_progress",
        model=model,
        tools=request.tools,
        parallel_tool_calls=request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True,
        store=request.store if request.HasField("store") else True,
    )
    for name in ("instructions", "max_output_tokens", "temperature", "top_p", "previous_response_id"):
        if request.HasField(name):
            setattr(response, name, getattr(request, name))
    if request.HasField("tool_choice"):
        response.tool_choice.CopyFrom(request.tool_choice)
    else:
        response.tool_choice.string_value = "auto"
    response.text.format.CopyFrom(request.text.format if request.text.HasField("format") else rpb.ResponseTextFormat())
    if not response.text.format.type:
        response.text.format.type = "text"
    if request.HasField("metadata"):
        response.metadata.CopyFrom(request.metadata)
    else:
        response.metadata.struct_value.SetInParent()
    return response


def finish(response: rpb.ResponseObject, items: list[rpb.ResponseOutputItem], finish_reason: str, usage: Any) -> None:
    """Fill in the output, usage and status of a finished response."""
    del response.output[:]
    response.output.extend(items)
    response.usage.CopyFrom(usage)
    response.status = _status(finish_reason)
    if response.status == "incomplete":
        response.incomplete_details.reason = "max_output_tokens"


def output_items(message: pb.ChatCompletionMessage, finish_reason: str) -> list[rpb.ResponseOutputItem]:
    """A chat completion's message as output items: its thoughts, then its tool calls or its text."""
    items = [reasoning_item(message.reasoning_content)] if message.HasField("reasoning_content") else []
    if message.tool_calls:
        return items + [function_call_item(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    return items + [message_item(message.content, _status(finish_reason))]


# -- streams -----------------------------------------------------------------------------------------
@dataclass
class _EventStream:
    """Chat chunk choices -> the Responses stream's events, numbered; items open and close as the
    text or the calls come (a text message first, each call after)."""

    response: rpb.ResponseObject
    items: list[rpb.ResponseOutputItem] = field(default_factory=list)
    _sequence: int = 0
    _open: rpb.ResponseOutputItem | None = None
    _text: str = ""

    def event(self, type_: str, **fields: Any) -> rpb.ResponseStreamEvent:
        event = rpb.ResponseStreamEvent(type=type_, sequence_number=self._sequence, **fields)
        self._sequence += 1
        return event

    def start(self) -> Iterator[rpb.ResponseStreamEvent]:
        yield self.event("response.created", response=self.response)
        yield self.event("response.in_progress", response=self.response)

    def choice(self, choice: pb.ChatCompletionChunkChoice) -> Iterator[rpb.ResponseStreamEvent]:
        if choice.delta.reasoning_content:
            if self._open is None or self._open.type != "reasoning":
                yield from self._close()
                yield from self._open_item(reasoning_item(None, "in_progress"))
            self._text += choice.delta.reasoning_content
            yield self.event(
                "response.reasoning_text.delta", **self._at(), content_index=0, delta=choice.delta.reasoning_content
            )
        if choice.delta.content:
            if self._open is None or self._open.type != "message":
                yield from self._close()
                yield from self._open_item(message_item("", "in_progress"))
                yield self.event("response.content_part.added", **self._at(), content_index=0, part=self._part(""))
            self._text += choice.delta.content
            yield self.event("response.output_text.delta", **self._at(), content_index=0, delta=choice.delta.content)
        for call in choice.delta.tool_calls:
            if call.HasField("id"):
                yield from self._close()
                yield from self._open_item(function_call_item(call.id, call.function.name, "", "in_progress"))
            if call.function.arguments and self._open is not None:
                self._open.arguments += call.function.arguments
                yield self.event("response.function_call_arguments.delta", **self._at(), delta=call.function.arguments)

    def finish(self, finish_reason: str, usage: rpb.ResponseUsage) -> Iterator[rpb.ResponseStreamEvent]:
        answered = any(item.type != "reasoning" for item in self.items) or (
            self._open is not None and self._open.type != "reasoning"
        )
        if not answered:  # no answer generated: an empty message, as unary
            yield from self._close()
            yield from self._open_item(message_item("", "in_progress"))
            yield self.event("response.content_part.added", **self._at(), content_index=0, part=self._part(""))
        yield from self._close(_status(finish_reason))
        finish(self.response, self.items, finish_reason, usage)
        yield self.event(f"response.{self.response.status}", response=self.response)

    def _at(self) -> dict[str, Any]:
        assert self._open is not None
        return {"output_index": len(self.items), "item_id": self._open.id}

    @staticmethod
    def _part(text: str) -> rpb.ResponseContentPart:
        return rpb.ResponseContentPart(type="output_text", text=text)

    def _open_item(self, item: rpb.ResponseOutputItem) -> Iterator[rpb.ResponseStreamEvent]:
        self._open, self._text = item, ""
        yield self.event("response.output_item.added", output_index=len(self.items), item=item)

    def _close(self, status: str = "completed") -> Iterator[rpb.ResponseStreamEvent]:
        item = self._open
        if item is None:
            return
        at = self._at()
        if item.type == "message":
            part = self._part(self._text)
            yield self.event("response.output_text.done", **at, content_index=0, text=self._text)
            yield self.event("response.content_part.done", **at, content_index=0, part=part)
            item.content.append(part)
        elif item.type == "reasoning":
            yield self.event("response.reasoning_text.done", **at, content_index=0, text=self._text)
            item.reasoning_content.append(rpb.ResponseReasoningText(type="reasoning_text", text=self._text))
        else:
            yield self.event("response.function_call_arguments.done", **at, arguments=item.arguments)
        item.status = status if item.type == "message" else "completed"
        yield self.event("response.output_item.done", output_index=at["output_index"], item=item)
        self.items.append(item)
        self._open = None


def _error_event(message: str, error_type: str) -> rpb.ResponseStreamEvent:
    openai_type = _ERROR_TYPES.get(
        error_type, "server_error" if error_type in _SERVER_ERRORS else "invalid_request_error"
    )
    return rpb.ResponseStreamEvent(
        type="error", error=rpb.ResponseError(message=message, type=openai_type, code=error_type)
    )


# -- routes ------------------------------------------------------------------------------------------
class ResponsesRoutes:
    """CreateResponse(Stream), GetResponse and DeleteResponse over one `Backend` and one store."""

    def __init__(self, backend: Backend, store: ResponseStore | None = None):
        self._backend = backend
        self._store = store or ResponseStore()

    def _chat(self, request: rpb.CreateResponseRequest) -> tuple[pb.ChatCompletionRequest, list[dict[str, Any]]]:
        history = []
        if request.HasField("previous_response_id"):
            history = self._store.get(request.previous_response_id, "Previous response").conversation
        return responses.chat_request(request, history)

    def _keep(self, response: rpb.ResponseObject, turn: list[dict[str, Any]]) -> None:
        if response.store:
            self._store.put(response, turn + responses.output_messages(response.output))

    @unary_errors
    async def CreateResponse(self, request: rpb.CreateResponseRequest, context: Context) -> rpb.ResponseObject:
        with self._backend.observer.track("CreateResponse", context) as call:
            engine = self._backend.engine()
            chat, turn = self._chat(request)
            plan, choices = await self._backend.front_end().chat(chat, stream=False)
            call.validated(choices[0])
            results = await engine.generate_all(choices)
            call.finished(results[0])
            completion = openai_responses.chat_response(results, plan, ResponseHeader("", 0, ""))
            choice = completion.choices[0]
            served = choices[0].adapter_id or engine.info.model_id  # the LoRA adapter that answers, or the base
            response = response_object(request, _new_id("resp"), int(time.time()), served)
            usage = _usage(completion.usage.prompt_tokens, completion.usage.completion_tokens)
            finish(response, output_items(choice.message, choice.finish_reason), choice.finish_reason, usage)
            self._keep(response, turn)
            return response

    @stream_errors(_error_event, status_before_first=True)
    async def CreateResponseStream(
        self, request: rpb.CreateResponseRequest, context: Context
    ) -> AsyncIterator[rpb.ResponseStreamEvent]:
        with self._backend.observer.track("CreateResponseStream", context) as call:
            chat, turn = self._chat(request)
            plan, choices = await self._backend.front_end().chat(chat, stream=True)
            engine = self._backend.engine()
            served = choices[0].adapter_id or engine.info.model_id  # the LoRA adapter that answers, or the base
            response = response_object(request, _new_id("resp"), int(time.time()), served)
            events, reader = _EventStream(response), ChatChoiceStream(0, plan)
            call.validated(choices[0])
            for event in events.start():
                yield event
            async for engine_event in engine_events(engine, choices, context):
                if engine_event is None:
                    yield rpb.ResponseStreamEvent(keep_alive=True)
                    continue
                _, output = engine_event
                call.streamed(output)
                for choice in reader.choices(output):
                    for event in events.choice(choice):
                        yield event
                    if choice.HasField("finish_reason"):
                        usage = _usage(reader.num_prompt_tokens, reader.num_generated_tokens)
                        for event in events.finish(choice.finish_reason, usage):
                            yield event
                        self._keep(response, turn)

    @unary_errors
    async def GetResponse(self, request: rpb.GetResponseRequest, context: Context) -> rpb.ResponseObject:
        return self._store.get(request.response_id).response

    @unary_errors
    async def DeleteResponse(self, request: rpb.DeleteResponseRequest, context: Context) -> rpb.DeleteResponseResponse:
        self._store.delete(request.response_id)
        return rpb.DeleteResponseResponse(id=request.response_id, object="response", deleted=True)
