"""OpenAI-style chat and text completions over the typed RPCs: `AsyncClient.chat`, `chat_stream`,
`complete`, `complete_stream` and `model` (the blocking `Client` derives its own from these).

Messages, tools, `tool_choice` and `response_format` are OpenAI's dicts, as its documentation writes
them; results are the frozen dataclasses of `textgen_client.openai_types`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from textgen_client import _openai_convert
from textgen_client._proto.textgen.v1 import generate_pb2 as pb
from textgen_client._types import Metadata
from textgen_client.errors import NotFoundError, from_kind
from textgen_client.openai_types import ChatCompletion, ChatCompletionChunk, ChatMessage, Completion, ModelCard

Message = dict[str, Any] | ChatMessage
# The arguments of a method that are not fields of the request body.
_CALL_ARGUMENTS = ("self", "extra", "include_usage", "timeout", "metadata")


def _request(message_type: type, arguments: dict[str, Any]) -> Any:
    """The request of a method's arguments (its `locals()`): OpenAI's fields, then `extra`'s."""
    body = {name: value for name, value in arguments.items() if name not in _CALL_ARGUMENTS}
    body.update(arguments.get("extra") or {})
    if arguments.get("include_usage"):
        body["stream_options"] = {"include_usage": True}
    return _openai_convert.build(message_type, body)


class _ChoicesEnd:
    """Converts an OpenAI stream's messages and knows when the stream is whole: every choice the
    request asked for has its finish reason (and the usage chunk came, when asked for). An in-band
    error chunk (the server sends them to REST gateways) raises its error; heartbeats and the
    gateway's end marker are skipped."""

    def __init__(self, request: Any, convert: Any) -> None:
        self._convert = convert
        self._num_choices = _openai_convert.num_choices(request)
        self._usage_pending = request.stream_options.include_usage
        self._finished: set[int] = set()

    @property
    def finished(self) -> bool:
        return len(self._finished) >= self._num_choices and not self._usage_pending

    def convert(self, message: Any) -> Any:
        if message.HasField("error"):
            kind = message.error.code if message.error.HasField("code") else "internal"
            raise from_kind(kind, message.error.message)
        if message.keep_alive or message.done:
            return None
        self._finished.update(c.index for c in message.choices if c.HasField("finish_reason"))
        if message.HasField("usage") and not message.choices:
            self._usage_pending = False
        return self._convert(message)


class OpenAIMethods:
    """The OpenAI-style methods of `AsyncClient` (a mixin: it uses the client's call plumbing)."""

    async def chat(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: dict[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_prompt: str | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> ChatCompletion:
        """A chat completion of `messages`: OpenAI's message dicts (`{"role": "user", "content": "Hi"}`,
        content a string or text parts; assistant `tool_calls`; `tool` messages with `tool_call_id`),
        or the `ChatMessage` of an earlier reply.

        Parameters are OpenAI's; `None` leaves the server's default (OpenAI's: `temperature` 1, and
        0 is greedy). `n` choices are generated, choice i seeded `seed + i`. `response_format`
        `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}` constrains the reply
        to the schema. `tools` are OpenAI's function tools; `tool_choice` "auto", "none", "required"
        or `{"type": "function", "function": {"name": ...}}`; a call's arguments are JSON text
        (`json.loads(call.function.arguments)`). `tool_prompt` is TGI's text put before the tool
        definitions in the prompt. `extra` adds other body fields (`top_k`, `repetition_penalty`,
        `max_completion_tokens`, `documents`, `chat_template_kwargs`, ...). `timeout` (seconds)
        overrides the client's default; `metadata` adds headers to this call.

        Raises:
            ValidationError (also for the server's `template_error` and `tool_error` kinds, see
            `error_type`), OverloadedError, DeadlineExceededError, ...: see `textgen_client.errors`.
        """
        request = _request(pb.ChatCompletionRequest, locals())
        reply = await self._unary("chat", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return _openai_convert.chat_completion(reply)

    async def chat_stream(
        self,
        messages: Sequence[Message],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: dict[int | str, float] | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        tool_prompt: str | None = None,
        include_usage: bool = False,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[ChatCompletionChunk]:
        """`chat`, streamed: chunks whose `choices[i].delta` carry the role first, then text (or
        tool-call pieces: the call's id and name, then pieces of its arguments, by `index`), and
        the last chunk of a choice its `finish_reason`. With `include_usage=True` a last chunk
        without choices carries `usage`. Parameters are `chat`'s; `timeout` is the deadline of the
        whole stream. Leaving the loop early cancels the call on the server. A call is retried only
        if it failed before its first chunk.

        Raises:
            the errors of `chat`; `IncompleteGenerationError` if the stream ended before every
            choice finished.
        """
        request = _request(pb.ChatCompletionRequest, locals())
        end = _ChoicesEnd(request, _openai_convert.chat_chunk)
        async for chunk in self._stream("chat_stream", request, timeout, metadata, end):  # type: ignore[attr-defined]
            yield chunk

    async def complete(
        self,
        prompt: str | list[str],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        echo: bool | None = None,
        logprobs: int | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: dict[int | str, float] | None = None,
        response_format: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Completion:
        """A text completion (OpenAI's legacy `/v1/completions`): `prompt` a string or a list of
        strings, `n` choices per prompt (choices `i * n ... i * n + n - 1` are prompt i's).
        `max_tokens` defaults to 16, as OpenAI's; `echo=True` puts the prompt before each text;
        `logprobs=k` returns each token's logprob and its k most likely alternatives. Other
        parameters as in `chat`.

        Raises:
            ValidationError, OverloadedError, DeadlineExceededError, ...: see `textgen_client.errors`.
        """
        request = _request(pb.CompletionRequest, locals())
        reply = await self._unary("complete", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return _openai_convert.completion(reply)

    async def complete_stream(
        self,
        prompt: str | list[str],
        *,
        model: str | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        echo: bool | None = None,
        logprobs: int | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        logit_bias: dict[int | str, float] | None = None,
        response_format: dict[str, Any] | None = None,
        include_usage: bool = False,
        extra: dict[str, Any] | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[Completion]:
        """`complete`, streamed: each event holds new text of some choices (those of several
        prompts interleave), a choice's last one its `finish_reason`; with `include_usage=True` a
        last event without choices carries `usage`. Parameters are `complete`'s. Leaving the loop
        early cancels the call on the server.

        Raises:
            the errors of `complete`; `IncompleteGenerationError` if the stream ended before every
            choice finished.
        """
        request = _request(pb.CompletionRequest, locals())
        end = _ChoicesEnd(request, _openai_convert.completion)
        async for event in self._stream("complete_stream", request, timeout, metadata, end):  # type: ignore[attr-defined]
            yield event

    async def model(
        self, model_id: str | None = None, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelCard:
        """The served model's card (OpenAI's `/v1/models/{model_id}`); `model_id=None` asks for the
        one model the server serves.

        Raises:
            NotFoundError: the server does not serve `model_id`.
        """
        unary, retry = self._unary, self._retry  # type: ignore[attr-defined]
        if model_id is not None:
            card = await unary("get_model", pb.GetModelRequest(id=model_id), timeout, metadata, retry)
            return _openai_convert.model_card(card)
        listing = await unary("list_models", pb.ListModelsRequest(), timeout, metadata, retry)
        if not listing.data:
            raise NotFoundError("The server lists no model", "not_found")
        return _openai_convert.model_card(listing.data[0])
