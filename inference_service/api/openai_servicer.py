"""OpenAI's routes of the TextGeneration service: chat and text completions, the model list.

A mixin of `TextGenerationServicer` (it uses the servicer's `engine()` and request observer), so
one gRPC service serves both APIs. Each method renders or splits the prompt, validates through
the engine like every other call, and generates all choices in one batch (`generate_all`,
`stream_all`). Conversions live in `openai_convert` and `openai_responses`, tools in `openai_tools`.

Stream errors: an error before the first chunk is a status (REST: an HTTP error in OpenAI's
shape); after it, a REST caller (the gateway's `x-textgen-inband-errors`) gets an error chunk, and
always a last `done` chunk that the gateway writes as `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import random
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from inference_service.api import convert, openai_convert, openai_responses
from inference_service.api.errors import abort, describe, log_failure, unary_errors, wants_inband_errors
from inference_service.api.keepalive import requested_interval, with_keepalives
from inference_service.api.openai_convert import ChatPlan, CompletionPlan
from inference_service.api.openai_responses import ChatChoiceStream, CompletionChoiceStream, ResponseHeader
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.validation import GenerateRequest, ValidatedRequest
from inference_service.errors import NotFoundError
from textgen.v1 import generate_pb2 as pb

Context = grpc.aio.ServicerContext
FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def openai_stream_errors(chunk_type: type) -> Callable:
    """Errors of an OpenAI stream method, as the module docstring says."""

    def decorate(handler: Callable) -> Callable:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Any, context: Context) -> AsyncIterator[Any]:
            inband, sent = wants_inband_errors(context), False
            try:
                async with contextlib.aclosing(handler(self, request, context)) as chunks:
                    async for chunk in chunks:
                        sent = True
                        yield chunk
            except Exception as error:
                if not (inband and sent):
                    await abort(context, error, handler.__name__)
                    return
                code, message, error_type = describe(error)
                log_failure(error, code, handler.__name__)
                yield chunk_type(error=pb.OpenAIError(message=message, code=error_type))
            if inband:
                yield chunk_type(done=True)

        return wrapper

    return decorate


def _choices(validated: ValidatedRequest, num_choices: int, seed_requested: bool) -> list[ValidatedRequest]:
    """`n` copies of a validated request, choice i seeded `seed + i` (or freshly when unseeded)."""
    seeds = openai_convert.choice_seeds(validated.sampling_params.seed, num_choices, seed_requested,
                                        lambda: random.getrandbits(64))
    return [validated if i == 0 else _reseeded(validated, seed) for i, seed in enumerate(seeds)]


def _reseeded(validated: ValidatedRequest, seed: int) -> ValidatedRequest:
    return dataclasses.replace(validated, sampling_params=dataclasses.replace(validated.sampling_params, seed=seed))


def _header(engine: AsyncEngine, prefix: str) -> ResponseHeader:
    return ResponseHeader(id=f"{prefix}-{uuid.uuid4().hex}", created=int(time.time()), model=engine.info.model_id)


def has_fill_in_middle(tokenizer: Any) -> bool:
    unknown = getattr(tokenizer, "unk_token_id", None)
    ids = [tokenizer.convert_tokens_to_ids(token) for token in FIM_TOKENS]
    return all(isinstance(i, int) and i != unknown for i in ids)


class OpenAIRoutes:
    """ChatCompletion(Stream), Completion(Stream) and GetModel; see the module docstring."""

    engine: Callable[[], AsyncEngine]
    _observer: Any

    async def _chat_request(self, request: pb.ChatCompletionRequest,
                            stream: bool) -> tuple[ChatPlan, list[ValidatedRequest]]:
        engine = self.engine()
        plan = openai_convert.chat_plan(request)
        prompt = await asyncio.to_thread(engine.chat_template.render, plan.messages, tools=plan.tools,
                                         documents=plan.documents, tool_prompt=plan.tool_prompt,
                                         variables=plan.template_variables)
        validated = await engine.validate(openai_convert.chat_generate_request(plan, prompt), stream=stream)
        return plan, _choices(validated, plan.num_choices, request.HasField("seed"))

    @unary_errors
    async def ChatCompletion(self, request: pb.ChatCompletionRequest, context: Context) -> pb.ChatCompletionResponse:
        with self._observer.track("ChatCompletion", context) as call:
            engine = self.engine()
            plan, choices = await self._chat_request(request, stream=False)
            call.validated(choices[0])
            results = await engine.generate_all(choices)
            call.finished(results[0])
            return openai_responses.chat_response(results, plan, _header(engine, "chatcmpl"))

    @openai_stream_errors(pb.ChatCompletionChunk)
    async def ChatCompletionStream(self, request: pb.ChatCompletionRequest,
                                   context: Context) -> AsyncIterator[pb.ChatCompletionChunk]:
        with self._observer.track("ChatCompletionStream", context) as call:
            engine = self.engine()
            plan, choices = await self._chat_request(request, stream=True)
            call.validated(choices[0])
            header = _header(engine, "chatcmpl")
            readers = [ChatChoiceStream(i, plan) for i in range(len(choices))]
            async for index, output in self._stream(engine, choices, context):
                if output is None:
                    yield pb.ChatCompletionChunk(keep_alive=True)
                    continue
                if index == 0:
                    call.streamed(output)
                chunk_choices = readers[index].choices(output)
                if chunk_choices:
                    yield openai_responses.chat_chunk(header, chunk_choices)
            if plan.include_usage:
                yield openai_responses.chat_chunk(header, usage_=openai_responses.usage(
                    readers[0].num_prompt_tokens, sum(r.num_generated_tokens for r in readers)))

    async def _completion_request(self, request: pb.CompletionRequest,
                                  stream: bool) -> tuple[CompletionPlan, list[ValidatedRequest]]:
        engine = self.engine()
        fim = has_fill_in_middle(engine.tokenizer)
        plan = openai_convert.completion_plan(request, has_fill_in_middle=fim)
        choices = []
        for prompt in plan.prompts:
            if request.HasField("suffix"):
                prompt = f"{FIM_TOKENS[0]}{prompt}{FIM_TOKENS[1]}{request.suffix}{FIM_TOKENS[2]}"
            generate = GenerateRequest(inputs=prompt, parameters=plan.parameters, strip_stop=True)
            validated = await engine.validate(generate, stream=stream)
            choices += _choices(validated, plan.num_choices, request.HasField("seed"))
        return plan, choices

    @unary_errors
    async def Completion(self, request: pb.CompletionRequest, context: Context) -> pb.CompletionResponse:
        with self._observer.track("Completion", context) as call:
            engine = self.engine()
            plan, choices = await self._completion_request(request, stream=False)
            call.validated(choices[0])
            results = await engine.generate_all(choices)
            call.finished(results[0])
            return openai_responses.completion_response(results, plan, _header(engine, "cmpl"))

    @openai_stream_errors(pb.CompletionResponse)
    async def CompletionStream(self, request: pb.CompletionRequest,
                               context: Context) -> AsyncIterator[pb.CompletionResponse]:
        with self._observer.track("CompletionStream", context) as call:
            engine = self.engine()
            plan, choices = await self._completion_request(request, stream=True)
            call.validated(choices[0])
            header = _header(engine, "cmpl")
            readers = [CompletionChoiceStream(i, plan.prompts[i // plan.num_choices], plan)
                       for i in range(len(choices))]
            async for index, output in self._stream(engine, choices, context):
                if output is None:
                    yield pb.CompletionResponse(keep_alive=True)
                    continue
                if index == 0:
                    call.streamed(output)
                choice = readers[index].choice(output)
                if choice is not None:
                    yield openai_responses.completion_chunk(header, [choice])
            if plan.include_usage:
                num_prompt = sum(readers[i * plan.num_choices].counts[0] for i in range(len(plan.prompts)))
                yield openai_responses.completion_chunk(header, usage_=openai_responses.usage(
                    num_prompt, sum(r.counts[1] for r in readers)))

    async def _stream(self, engine: AsyncEngine, choices: list[ValidatedRequest],
                      context: Context) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, output) as they come, and (-1, None) heartbeats when the caller asked."""
        async with (contextlib.aclosing(engine.stream_all(choices)) as outputs,
                    contextlib.aclosing(with_keepalives(outputs, requested_interval(context))) as events):
            async for event in events:
                yield (-1, None) if event is None else event

    @unary_errors
    async def GetModel(self, request: pb.GetModelRequest, context: Context) -> pb.ModelCard:
        model_id, asked = self.engine().info.model_id, urllib.parse.unquote(request.id)  # SDKs send `/` as %2F
        if asked != model_id:
            raise NotFoundError(f"The model '{asked}' does not exist: this server serves '{model_id}'")
        return convert.model_card(model_id)
