"""OpenAI-style chat and text completions over the typed RPCs: `AsyncClient.chat`, `chat_stream`,
`complete`, `complete_stream` (the blocking `Client` derives its own from these).

Messages, tools, `tool_choice` and `response_format` are OpenAI's dicts, as its documentation writes
them; results are the frozen dataclasses of `textgen_client.openai_types`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from textgen_client import _openai_convert
from textgen_client._proto.textgen.v1 import generate_pb2 as pb
from textgen_client.errors import from_kind
from textgen_client.openai_types import ChatCompletion, ChatCompletionChunk, Completion

if TYPE_CHECKING:
    from textgen_client._async_client import Metadata


def _stream_request(message_type: type, body: dict[str, Any], parameters: dict[str, Any],
                    include_usage: bool) -> Any:
    body = {**body, **(parameters.pop("extra", None) or {}), **parameters}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return _openai_convert.build(message_type, body)


class _ChoicesEnd:
    """An OpenAI stream is whole once every choice it started has a finish reason; an in-band
    error chunk (sent to REST gateways) raises the error it carries."""

    def __init__(self, convert: Any) -> None:
        self._convert = convert
        self._open: set[int] = set()
        self._seen = False

    @property
    def finished(self) -> bool:
        return self._seen and not self._open

    def convert(self, message: Any) -> Any:
        if message.HasField("error"):
            raise from_kind(message.error.code or "internal", message.error.message)
        if message.keep_alive or message.done:
            return None
        for choice in message.choices:
            self._seen = True
            (self._open.discard if choice.HasField("finish_reason") else self._open.add)(choice.index)
        return self._convert(message)


class OpenAIMethods:
    """The OpenAI-style methods of `AsyncClient` (a mixin: it uses the client's call plumbing)."""

    async def chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                   max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                   n: int | None = None, stop: str | list[str] | None = None, seed: int | None = None,
                   frequency_penalty: float | None = None, presence_penalty: float | None = None,
                   logit_bias: dict[int | str, float] | None = None, logprobs: bool | None = None,
                   top_logprobs: int | None = None, response_format: dict[str, Any] | None = None,
                   tools: list[dict[str, Any]] | None = None, tool_choice: str | dict[str, Any] | None = None,
                   parallel_tool_calls: bool | None = None, tool_prompt: str | None = None,
                   extra: dict[str, Any] | None = None, timeout: float | None = None,
                   metadata: Metadata | None = None) -> ChatCompletion:
        """A chat completion of `messages` (OpenAI's: `[{"role": "user", "content": "Hi"}]`, content a
        string or text parts; assistant `tool_calls`; `tool` messages with `tool_call_id`).

        Parameters are OpenAI's (`temperature=0` is greedy; `n` choices, seeded `seed + i`;
        `response_format` `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`
        constrains the reply; `tools` with `tool_choice` "auto", "required", "none" or a named
        function); `tool_prompt` is TGI's text before the tool definitions; `extra` adds other body
        fields (`top_k`, `repetition_penalty`, `documents`, `chat_template_kwargs`, ...).

        Raises:
            ValidationError (also for the server's `template_error`/`tool_error` kinds, see
            `error_type`), OverloadedError, ...: see `textgen_client.errors`.
        """
        request = _openai_convert.build(pb.ChatCompletionRequest, {
            "messages": messages, "model": model, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "n": n, "stop": stop, "seed": seed, "frequency_penalty": frequency_penalty,
            "presence_penalty": presence_penalty, "logit_bias": logit_bias, "logprobs": logprobs,
            "top_logprobs": top_logprobs, "response_format": response_format, "tools": tools,
            "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls, "tool_prompt": tool_prompt,
            **(extra or {})})
        reply = await self._unary("chat", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return _openai_convert.chat_completion(reply)

    async def chat_stream(self, messages: list[dict[str, Any]], *, include_usage: bool = False,
                          timeout: float | None = None, metadata: Metadata | None = None,
                          **parameters: Any) -> AsyncIterator[ChatCompletionChunk]:
        """`chat`, streamed: chunks whose `choices[i].delta` carry the role first, then text (or
        tool-call pieces), the last chunk of a choice its `finish_reason`; with `include_usage=True`
        a final chunk without choices carries `usage`. Takes `chat`'s keyword parameters.
        Leaving the loop early cancels the call on the server.

        Raises:
            the errors of `chat`; `IncompleteGenerationError` if the stream ended early.
        """
        request = _stream_request(pb.ChatCompletionRequest, {"messages": messages}, parameters, include_usage)
        end = _ChoicesEnd(_openai_convert.chat_chunk)
        async for chunk in self._stream("chat_stream", request, timeout, metadata, end):  # type: ignore[attr-defined]
            yield chunk

    async def complete(self, prompt: str | list[str], *, model: str | None = None, max_tokens: int | None = None,
                       temperature: float | None = None, top_p: float | None = None, n: int | None = None,
                       stop: str | list[str] | None = None, seed: int | None = None, echo: bool | None = None,
                       logprobs: int | None = None, frequency_penalty: float | None = None,
                       presence_penalty: float | None = None, extra: dict[str, Any] | None = None,
                       timeout: float | None = None, metadata: Metadata | None = None) -> Completion:
        """A text completion (OpenAI's `/v1/completions`): `prompt` a string or a list of strings,
        one choice per prompt (times `n`); `echo=True` puts the prompt before each text.

        Raises:
            ValidationError, OverloadedError, ...: see `textgen_client.errors`.
        """
        request = _openai_convert.build(pb.CompletionRequest, {
            "prompt": prompt, "model": model, "max_tokens": max_tokens, "temperature": temperature,
            "top_p": top_p, "n": n, "stop": stop, "seed": seed, "echo": echo, "logprobs": logprobs,
            "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty, **(extra or {})})
        reply = await self._unary("complete", request, timeout, metadata, self._retry)  # type: ignore[attr-defined]
        return _openai_convert.completion(reply)

    async def complete_stream(self, prompt: str | list[str], *, include_usage: bool = False,
                              timeout: float | None = None, metadata: Metadata | None = None,
                              **parameters: Any) -> AsyncIterator[Completion]:
        """`complete`, streamed: each event holds new text for some choices. Takes `complete`'s
        keyword parameters.

        Raises:
            the errors of `complete`; `IncompleteGenerationError` if the stream ended early.
        """
        request = _stream_request(pb.CompletionRequest, {"prompt": prompt}, parameters, include_usage)
        end = _ChoicesEnd(_openai_convert.completion)
        async for event in self._stream("complete_stream", request, timeout, metadata, end):  # type: ignore[attr-defined]
            yield event
