"""OpenAI's routes: chat and text completions (unary and streamed) and the model card.

Each method asks the front end for one engine request per choice (`n` choices, each prompt of a
completion), generates them all in one batch, and converts the results (`openai_responses`).
Streams go through one loop for both routes (`_stream_choices`); errors as `streaming` says, with a
last `done` chunk that the gateway writes as `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from inference_service.api import convert, openai_responses
from inference_service.api.backend import Backend
from inference_service.api.errors import unary_errors
from inference_service.api.openai_responses import ChatChoiceStream, CompletionChoiceStream, ResponseHeader
from inference_service.api.streaming import engine_events, stream_errors
from inference_service.errors import NotFoundError, quoted
from inference_service.sampling_params import EngineRequest
from textgen.v1 import generate_pb2 as pb

Context = grpc.aio.ServicerContext


def _header(model_id: str, prefix: str) -> ResponseHeader:
    return ResponseHeader(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=model_id)


def _errors_of(chunk_type: type) -> Callable:
    return stream_errors(
        lambda message, error_type: chunk_type(error=pb.OpenAIError(message=message, code=error_type)),
        done_message=lambda: chunk_type(done=True),
        status_before_first=True,
    )


class OpenAIRoutes:
    """ChatCompletion(Stream), Completion(Stream) and GetModel over one `Backend`."""

    def __init__(self, backend: Backend):
        self._backend = backend

    @unary_errors
    async def ChatCompletion(self, request: pb.ChatCompletionRequest, context: Context) -> pb.ChatCompletionResponse:
        with self._backend.observer.track("ChatCompletion", context) as call:
            engine = self._backend.engine()
            plan, choices = await self._backend.front_end().chat(request, stream=False)
            call.validated(choices[0])
            results = await engine.generate_all(choices)
            call.finished(results[0])
            return openai_responses.chat_response(results, plan, _header(engine.info.model_id, "chatcmpl"))

    @_errors_of(pb.ChatCompletionChunk)
    async def ChatCompletionStream(
        self, request: pb.ChatCompletionRequest, context: Context
    ) -> AsyncIterator[pb.ChatCompletionChunk]:
        with self._backend.observer.track("ChatCompletionStream", context) as call:
            plan, choices = await self._backend.front_end().chat(request, stream=True)
            header = _header(self._backend.engine().info.model_id, "chatcmpl")
            readers = [ChatChoiceStream(i, plan) for i in range(len(choices))]
            chunks = self._stream_choices(
                call,
                context,
                choices,
                readers,
                num_prompts=1,
                chunk=lambda choices_, usage: openai_responses.chat_chunk(header, choices_, usage_=usage),
                keep_alive=pb.ChatCompletionChunk(keep_alive=True),
                include_usage=plan.include_usage,
            )
            async for chunk in chunks:
                yield chunk

    @unary_errors
    async def Completion(self, request: pb.CompletionRequest, context: Context) -> pb.CompletionResponse:
        with self._backend.observer.track("Completion", context) as call:
            engine = self._backend.engine()
            plan, choices = await self._backend.front_end().completion(request)
            call.validated(choices[0])
            results = await engine.generate_all(choices)
            call.finished(results[0])
            return openai_responses.completion_response(results, plan, _header(engine.info.model_id, "cmpl"))

    @_errors_of(pb.CompletionResponse)
    async def CompletionStream(
        self, request: pb.CompletionRequest, context: Context
    ) -> AsyncIterator[pb.CompletionResponse]:
        with self._backend.observer.track("CompletionStream", context) as call:
            plan, choices = await self._backend.front_end().completion(request)
            header = _header(self._backend.engine().info.model_id, "cmpl")
            readers = [
                CompletionChoiceStream(i, plan.prompts[i // plan.num_choices], plan) for i in range(len(choices))
            ]
            chunks = self._stream_choices(
                call,
                context,
                choices,
                readers,
                num_prompts=len(plan.prompts),
                chunk=lambda choices_, usage: openai_responses.completion_chunk(header, choices_, usage_=usage),
                keep_alive=pb.CompletionResponse(keep_alive=True),
                include_usage=plan.include_usage,
            )
            async for chunk in chunks:
                yield chunk

    async def _stream_choices(
        self,
        call: Any,
        context: Context,
        choices: Sequence[EngineRequest],
        readers: Sequence[ChatChoiceStream | CompletionChoiceStream],
        *,
        num_prompts: int,
        chunk: Callable[[Sequence[Any], pb.Usage | None], Any],
        keep_alive: Any,
        include_usage: bool,
    ) -> AsyncIterator[Any]:
        """The chunks of every choice as their outputs come, then the usage chunk when asked; each
        prompt's first choice counts its prompt tokens once."""
        call.validated(choices[0])
        async for event in engine_events(self._backend.engine(), choices, context):
            if event is None:
                yield keep_alive
                continue
            index, output = event
            if index == 0:
                call.streamed(output)
            choice_chunks = readers[index].choices(output)
            if choice_chunks:
                yield chunk(choice_chunks, None)
        if include_usage:
            num_choices = len(readers) // num_prompts
            num_prompt_tokens = sum(reader.num_prompt_tokens for reader in readers[::num_choices])
            yield chunk((), openai_responses.usage(num_prompt_tokens, sum(r.num_generated_tokens for r in readers)))

    @unary_errors
    async def GetModel(self, request: pb.GetModelRequest, context: Context) -> pb.ModelCard:
        info, asked = self._backend.engine().info, request.id  # the gateway decoded the path (`%2F`, `%25`)
        if asked != info.model_id:
            raise NotFoundError(f"The model {quoted(asked)} does not exist: this server serves '{info.model_id}'")
        return convert.model_card(info)
