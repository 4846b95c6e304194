"""OpenAI Responses-style calls over the typed RPCs: `AsyncClient.create_response`,
`create_response_stream`, `get_response` and `delete_response` (the blocking `Client` derives its
own from these).

`input`, tools (Responses' flat function tools), `tool_choice` and `text` are OpenAI's JSON, as its
documentation writes them; results are `textgen_client.responses_types.Response` and, for streams,
the events as OpenAI's JSON dicts. Stored responses live in the memory of the server replica that
answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import json_format

from textgen_client import _openai_convert
from textgen_client._proto.textgen.v1 import responses_pb2 as rpb
from textgen_client._types import Metadata
from textgen_client.errors import from_kind
from textgen_client.responses_types import Response

_CALL_ARGUMENTS = ("self", "extra", "timeout", "metadata")


def _request(arguments: dict[str, Any]) -> rpb.CreateResponseRequest:
    body = {name: value for name, value in arguments.items() if name not in _CALL_ARGUMENTS}
    body.update(arguments.get("extra") or {})
    return _openai_convert.build(rpb.CreateResponseRequest, body)


def _json(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _item(item: rpb.ResponseOutputItem) -> dict[str, Any]:
    converted = _json(item)
    if item.type == "reasoning":
        converted["content"] = converted.pop("reasoning_content", [])
    return converted


def response(reply: rpb.ResponseObject) -> Response:
    return Response(
        id=reply.id,
        status=reply.status,
        model=reply.model,
        output=[_item(item) for item in reply.output],
        usage=_json(reply.usage),
        previous_response_id=reply.previous_response_id if reply.HasField("previous_response_id") else None,
    )


class _ResponseEnd:
    """A Responses stream is whole at its `response.completed` (or `.incomplete`); an in-band error
    event raises; heartbeats are skipped."""

    def __init__(self) -> None:
        self.finished = False

    def convert(self, event: rpb.ResponseStreamEvent) -> dict[str, Any] | None:
        if event.HasField("error"):
            raise from_kind(event.error.code if event.error.HasField("code") else "internal", event.error.message)
        if event.keep_alive:
            return None
        self.finished = event.type in ("response.completed", "response.incomplete")
        converted = {**_json(event), "sequence_number": event.sequence_number}  # 0 too
        if event.HasField("item"):
            converted["item"] = _item(event.item)
        if event.HasField("response"):
            converted["response"] = {**_json(event.response), "output": [_item(i) for i in event.response.output]}
        return converted


class ResponsesMethods:
    """The Responses-style methods of `AsyncClient` (a mixin: it uses the client's call plumbing)."""

    async def create_response(
        self,
        input: str | list[dict[str, Any]],  # noqa: A002 — OpenAI's name
        *,
        model: str | None = None,
        instructions: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        text: dict[str, Any] | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        parallel_tool_calls: bool | None = None,
        store: bool | None = None,
        previous_response_id: str | None = None,
        seed: int | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Response:
        """A response to `input` (a string, or items: messages, `function_call` and
        `function_call_output` items), as OpenAI's Responses API; `previous_response_id` continues a
        stored response's conversation (on the same server replica).

        Raises:
            ValidationError, NotFoundError (an unknown `previous_response_id`), ...: see
            `textgen_client.errors`.
        """
        request = _request(locals())
        reply = await self._unary("create_response", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return response(reply)

    async def create_response_stream(
        self,
        input: str | list[dict[str, Any]],  # noqa: A002 — OpenAI's name
        *,
        model: str | None = None,
        instructions: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        text: dict[str, Any] | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        parallel_tool_calls: bool | None = None,
        store: bool | None = None,
        previous_response_id: str | None = None,
        seed: int | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """`create_response`, streamed as OpenAI's typed events (dicts with `type` and
        `sequence_number`): response.created ... response.completed (or response.incomplete).

        Raises:
            the errors of `create_response`; `IncompleteGenerationError` if the stream ended first.
        """
        request = _request(locals())
        end = _ResponseEnd()
        async for event in self._stream("create_response_stream", request, timeout, metadata, end):  # type: ignore[attr-defined]
            yield event

    async def get_response(
        self, response_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> Response:
        """A stored response. Raises NotFoundError when this server replica does not keep it."""
        request = rpb.GetResponseRequest(response_id=response_id)
        reply = await self._unary("get_response", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return response(reply)

    async def delete_response(
        self, response_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> None:
        """Forget a stored response. Raises NotFoundError when this server replica does not keep it."""
        request = rpb.DeleteResponseRequest(response_id=response_id)
        await self._unary("delete_response", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
