"""`AsyncClient`: the one implementation of every call (the blocking `Client` runs it too)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
from google.api import httpbody_pb2

from textgen_client import _channel, _convert
from textgen_client._anthropic_methods import AnthropicMethods
from textgen_client._openai_methods import OpenAIMethods
from textgen_client._proto.textgen.v1 import anthropic_pb2 as apb
from textgen_client._proto.textgen.v1 import generate_pb2 as pb
from textgen_client._retry import NO_RETRY, RetryPolicy, is_retryable
from textgen_client._tracing import trace_metadata
from textgen_client._types import Metadata
from textgen_client._version import __version__
from textgen_client.errors import (
    DeadlineExceededError,
    IncompleteGenerationError,
    TextGenerationError,
    UnavailableError,
    from_kind,
    from_rpc_error,
)
from textgen_client.types import Grammar, InfoResponse, Response, SimpleToken, StreamResponse

DEFAULT_TARGET = "localhost:50051"
_SERVICE = "/textgen.v1.TextGeneration/"


def _pairs(metadata: Metadata | None) -> list[tuple[str, str]]:
    items = metadata.items() if isinstance(metadata, Mapping) else (metadata or ())
    return [(key.lower(), value) for key, value in items]


class _Methods:
    """Method handles of one channel (gRPC binds them to it)."""

    def __init__(self, channel: grpc.aio.Channel):
        self.channel = channel
        self.generate = channel.unary_unary(
            _SERVICE + "Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        self.generate_stream = channel.unary_stream(
            _SERVICE + "GenerateStream",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.StreamResponse.FromString,
        )
        self.tokenize = channel.unary_unary(
            _SERVICE + "Tokenize",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.TokenizeResponse.FromString,
        )
        self.info = channel.unary_unary(
            _SERVICE + "Info",
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.InfoResponse.FromString,
        )
        self.health = channel.unary_unary(
            _SERVICE + "Health",
            request_serializer=pb.HealthRequest.SerializeToString,
            response_deserializer=httpbody_pb2.HttpBody.FromString,
        )
        self.list_models = channel.unary_unary(
            _SERVICE + "ListModels",
            request_serializer=pb.ListModelsRequest.SerializeToString,
            response_deserializer=pb.ListModelsResponse.FromString,
        )
        self.get_model = channel.unary_unary(
            _SERVICE + "GetModel",
            request_serializer=pb.GetModelRequest.SerializeToString,
            response_deserializer=pb.ModelCard.FromString,
        )
        self.chat = channel.unary_unary(
            _SERVICE + "ChatCompletion",
            request_serializer=pb.ChatCompletionRequest.SerializeToString,
            response_deserializer=pb.ChatCompletionResponse.FromString,
        )
        self.chat_stream = channel.unary_stream(
            _SERVICE + "ChatCompletionStream",
            request_serializer=pb.ChatCompletionRequest.SerializeToString,
            response_deserializer=pb.ChatCompletionChunk.FromString,
        )
        self.complete = channel.unary_unary(
            _SERVICE + "Completion",
            request_serializer=pb.CompletionRequest.SerializeToString,
            response_deserializer=pb.CompletionResponse.FromString,
        )
        self.complete_stream = channel.unary_stream(
            _SERVICE + "CompletionStream",
            request_serializer=pb.CompletionRequest.SerializeToString,
            response_deserializer=pb.CompletionResponse.FromString,
        )
        self.messages = channel.unary_unary(
            _SERVICE + "Messages",
            request_serializer=apb.MessagesRequest.SerializeToString,
            response_deserializer=apb.MessagesResponse.FromString,
        )
        self.messages_stream = channel.unary_stream(
            _SERVICE + "MessagesStream",
            request_serializer=apb.MessagesRequest.SerializeToString,
            response_deserializer=apb.MessagesStreamEvent.FromString,
        )
        self.count_message_tokens = channel.unary_unary(
            _SERVICE + "CountMessageTokens",
            request_serializer=apb.MessagesRequest.SerializeToString,
            response_deserializer=apb.MessageTokensCount.FromString,
        )


class _StreamEnd:
    """Converts a stream's messages (an in-band error raises, a heartbeat is None) and knows when
    the stream is whole: for `GenerateStream`, once a message carries `generated_text`."""

    def __init__(self) -> None:
        self.finished = False

    def convert(self, message: Any) -> Any:
        if message.HasField("error"):
            raise from_kind(message.error_type, message.error)
        if message.keep_alive:  # a heartbeat, sent only to callers that ask (the REST gateway)
            return None
        response = _convert.stream_response(message)
        self.finished = response.generated_text is not None
        return response


class AsyncClient(OpenAIMethods, AnthropicMethods):
    """asyncio client of a textgen server: `await client.generate(...)`,
    `async for response in client.generate_stream(...)`.

    `Client` has the same methods, blocking. One client holds one channel (connections are
    opened on the first call and shared by all calls); use it as an async context manager or
    `await client.close()` when done.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        api_key: str | None = None,
        tls: bool = False,
        credentials: grpc.ChannelCredentials | None = None,
        timeout: float | None = 60.0,
        retry: RetryPolicy | None = None,
        metadata: Metadata | None = None,
        load_balancing: str | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ):
        """Set up a client; nothing connects until the first call.

        Args:
            target: `host:port`; `dns:///host:port` or `ipv4:a:port,b:port` for several replicas
                (calls are spread round-robin); or an `http(s)://host[:port]` URL.
            api_key: sent with every call as `authorization: Bearer <api_key>`.
            tls: use TLS with the system's root certificates (implied by `https://` targets).
            credentials: TLS credentials of your own (`grpc.ssl_channel_credentials(...)`, e.g. a
                private CA or a client certificate); implies TLS.
            timeout: default deadline of each call in seconds, retries included; `None` for none.
                The server stops generating for a call whose deadline has passed.
            retry: backoff policy for calls that never reached a server (connection refused,
                UNAVAILABLE before any token); `RetryPolicy(max_retries=0)` turns retries off.
            metadata: headers sent with every call (e.g. routing keys for a proxy).
            load_balancing: gRPC load-balancing policy name; default `round_robin` for targets
                that can name several servers, gRPC's `pick_first` otherwise.
            channel_options: extra gRPC channel options, `(name, value)` pairs.
        """
        self._target = _channel.parse_target(target)
        self._tls = tls
        self._credentials = credentials
        self._timeout = timeout
        self._retry = retry if retry is not None else RetryPolicy()
        self._metadata = _pairs(metadata)
        if api_key:
            self._metadata.append(("authorization", f"Bearer {api_key}"))
        user_agent = ("grpc.primary_user_agent", f"textgen-client/{__version__}")
        self._options = _channel.channel_options(self._target, load_balancing, (user_agent, *channel_options))
        self._methods: _Methods | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def target(self) -> str:
        """The gRPC target calls go to."""
        return self._target.address

    # -- calls ----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str,
        *,
        do_sample: bool = False,
        max_new_tokens: int | None = 20,
        best_of: int | None = None,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        decoder_input_details: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | None = None,
        details: bool = True,
        adapter_id: str | None = None,
        forced_bos_token: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> Response:
        """Generate text for `prompt` and return it whole, with token details.

        Parameters are the `text-generation` client's (ranges are the server's; see its README).
        `max_new_tokens=None` lets the server generate up to its `max_total_tokens`.
        `stop_sequences` end generation when produced (the stop text stays in the result).
        `best_of=n` samples n candidates and returns the most likely, the others in
        `details.best_of_sequences`. `decoder_input_details=True` adds the prompt tokens and
        their logprobs (`details.prefill`). `details=False` skips token details.
        `forced_bos_token` (encoder-decoders) is the token the output starts with, e.g. M2M100's
        target language `"__fr__"`; the model's generation config gives the default.
        `timeout` (seconds) overrides the client's default; `metadata` adds headers to this call.

        Raises:
            ValidationError, OverloadedError, GenerationError, DeadlineExceededError,
            UnavailableError, ...: see `textgen_client.errors`.
        """
        request = _convert.build_request(
            prompt,
            {
                "do_sample": do_sample,
                "max_new_tokens": max_new_tokens,
                "best_of": best_of,
                "repetition_penalty": repetition_penalty,
                "frequency_penalty": frequency_penalty,
                "return_full_text": return_full_text,
                "seed": seed,
                "stop_sequences": stop_sequences,
                "temperature": temperature,
                "top_k": top_k,
                "top_p": top_p,
                "truncate": truncate,
                "typical_p": typical_p,
                "watermark": watermark,
                "details": details,
                "decoder_input_details": decoder_input_details,
                "top_n_tokens": top_n_tokens,
                "grammar": grammar,
                "adapter_id": adapter_id,
                "forced_bos_token": forced_bos_token,
            },
        )
        reply = await self._unary("generate", request, timeout, metadata, self._retry)
        return _convert.response(reply)

    async def generate_stream(
        self,
        prompt: str,
        *,
        do_sample: bool = False,
        max_new_tokens: int | None = 20,
        repetition_penalty: float | None = None,
        frequency_penalty: float | None = None,
        return_full_text: bool = False,
        seed: int | None = None,
        stop_sequences: list[str] | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        truncate: int | None = None,
        typical_p: float | None = None,
        watermark: bool = False,
        top_n_tokens: int | None = None,
        grammar: Grammar | None = None,
        details: bool = True,
        adapter_id: str | None = None,
        forced_bos_token: str | None = None,
        timeout: float | None = None,
        metadata: Metadata | None = None,
    ) -> AsyncIterator[StreamResponse]:
        """Generate text for `prompt`, one `StreamResponse` per token as soon as it is sampled.

        The last response carries `generated_text` (and `details`, unless `details=False`).
        Parameters are those of `generate`, less `best_of` and `decoder_input_details`.
        Leaving the loop early (`break`, an exception, closing the iterator) cancels the call,
        and the server stops generating for it. `timeout` is the deadline of the whole stream.
        A call is retried only if it failed before the first token arrived.

        Raises:
            the errors of `generate`; `IncompleteGenerationError` if the stream ended without
            its final response.
        """
        request = _convert.build_request(
            prompt,
            {
                "do_sample": do_sample,
                "max_new_tokens": max_new_tokens,
                "repetition_penalty": repetition_penalty,
                "frequency_penalty": frequency_penalty,
                "return_full_text": return_full_text,
                "seed": seed,
                "stop_sequences": stop_sequences,
                "temperature": temperature,
                "top_k": top_k,
                "top_p": top_p,
                "truncate": truncate,
                "typical_p": typical_p,
                "watermark": watermark,
                "details": details,
                "top_n_tokens": top_n_tokens,
                "grammar": grammar,
                "adapter_id": adapter_id,
                "forced_bos_token": forced_bos_token,
            },
        )
        async for response in self._stream("generate_stream", request, timeout, metadata, _StreamEnd()):
            yield response

    async def tokenize(
        self, prompt: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> list[SimpleToken]:
        """The tokens of `prompt` as the model sees it (special tokens included), with offsets."""
        request = _convert.build_request(prompt, {})
        reply = await self._unary("tokenize", request, timeout, metadata, self._retry)
        return _convert.simple_tokens(reply)

    async def info(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> InfoResponse:
        """The served model, the server's limits and the engine's current load."""
        reply = await self._unary("info", pb.InfoRequest(), timeout, metadata, self._retry)
        return _convert.info(reply)

    async def health(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> bool:
        """True when the server is serving; False when it is unreachable, loading or draining.

        Never retried: it reports the state now. Other failures (e.g. `AuthenticationError`,
        `DeadlineExceededError`) are raised.
        """
        try:
            await self._unary("health", pb.HealthRequest(), timeout, metadata, NO_RETRY)
        except UnavailableError:
            return False
        return True

    # -- lifecycle --------------------------------------------------------------------------
    async def close(self) -> None:
        """Close the channel; calls in flight are cancelled. The client can't be used after."""
        self._closed = True
        if self._methods is not None:
            await self._methods.channel.close(None)
            self._methods = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- plumbing ---------------------------------------------------------------------------
    def _bind(self) -> _Methods:
        """The method handles, on a channel of the running event loop (made on first use)."""
        if self._closed:
            raise RuntimeError("the client is closed")
        loop = asyncio.get_running_loop()
        if self._methods is None or self._loop is not loop:
            channel = _channel.create_channel(self._target, self._tls, self._credentials, self._options)
            self._methods, self._loop = _Methods(channel), loop
        return self._methods

    def _call_metadata(self, metadata: Metadata | None) -> list[tuple[str, str]]:
        return [*self._metadata, *_pairs(metadata), *trace_metadata()]

    def _deadline(self, timeout: float | None) -> float | None:
        seconds = self._timeout if timeout is None else timeout
        return None if seconds is None else asyncio.get_running_loop().time() + seconds

    @staticmethod
    def _remaining(deadline: float | None) -> float | None:
        if deadline is None:
            return None
        remaining = deadline - asyncio.get_running_loop().time()
        if remaining <= 0:
            raise DeadlineExceededError("Deadline Exceeded", "deadline_exceeded", grpc.StatusCode.DEADLINE_EXCEEDED)
        return remaining

    async def _unary(
        self, name: str, request: Any, timeout: float | None, metadata: Metadata | None, policy: RetryPolicy
    ) -> Any:
        deadline = self._deadline(timeout)
        retry = 0
        while True:
            method = getattr(self._bind(), name)
            try:
                return await method(request, timeout=self._remaining(deadline), metadata=self._call_metadata(metadata))
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
            if not is_retryable(error, received_any=False):
                raise error
            await self._backoff(error, retry, deadline, policy)
            retry += 1

    async def _stream(
        self, name: str, request: Any, timeout: float | None, metadata: Metadata | None, end: _StreamEnd
    ) -> AsyncIterator[Any]:
        """The converted messages of a streaming call; retried only before its first message."""
        deadline = self._deadline(timeout)
        retry = 0
        while True:
            call = getattr(self._bind(), name)(
                request, timeout=self._remaining(deadline), metadata=self._call_metadata(metadata)
            )
            received_any = False
            try:
                async for message in call:
                    received_any = True
                    converted = end.convert(message)
                    if converted is not None:
                        yield converted
                if not end.finished:
                    raise IncompleteGenerationError("Incomplete generation stream", "incomplete_generation")
                return
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
            finally:
                call.cancel()  # no-op once finished; stops the server's work when we leave early
            if not is_retryable(error, received_any):
                raise error
            await self._backoff(error, retry, deadline)
            retry += 1

    async def _backoff(
        self, error: TextGenerationError, retry: int, deadline: float | None, policy: RetryPolicy | None = None
    ) -> None:
        """Wait before retry number `retry`, or raise `error` when out of retries or time."""
        policy = policy or self._retry
        delay = policy.backoff(retry)
        out_of_time = deadline is not None and asyncio.get_running_loop().time() + delay >= deadline
        if retry >= policy.max_retries or out_of_time:
            raise error
        await asyncio.sleep(delay)
