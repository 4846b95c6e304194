"""The TextGeneration servicer: convert, validate, call the engine, convert back.

Each method stays a few lines; conversions live in `convert`, status codes in `errors`, and the
engine owns validation, batching and cancellation (closing a stream aborts its request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
import prometheus_client
from google.api import httpbody_pb2

from inference_service.api import convert, docs
from inference_service.api.errors import stream_errors, unary_errors
from inference_service.api.keepalive import requested_interval, with_keepalives
from inference_service.api.openai_servicer import OpenAIRoutes
from inference_service.config import SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.errors import NotFoundError, UnavailableError
from inference_service.observability.requests import RequestObserver
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

Context = grpc.aio.ServicerContext
# (content type, body) of the Metrics RPC; the observability layer plugs its registry in here.
MetricsRenderer = Callable[[], tuple[str, bytes]]


def render_prometheus_registry() -> tuple[str, bytes]:
    body = prometheus_client.generate_latest(prometheus_client.REGISTRY)
    return prometheus_client.CONTENT_TYPE_LATEST, body


class TextGenerationServicer(OpenAIRoutes, generate_pb2_grpc.TextGenerationServicer):
    """textgen.v1.TextGeneration over one `AsyncEngine` (attached once the model is loaded); OpenAI's
    routes come from `OpenAIRoutes`."""

    def __init__(self, scheduler: SchedulerConfig, metrics: MetricsRenderer = render_prometheus_registry,
                 observer: RequestObserver | None = None):
        self._scheduler = scheduler
        self._metrics = metrics
        self._observer = observer or RequestObserver()  # counts, traces and logs each generation call
        self._engine: AsyncEngine | None = None
        self._draining = False

    def attach(self, engine: AsyncEngine) -> None:
        self._engine = engine

    def drain(self) -> None:
        """Shutting down: Health answers UNAVAILABLE (the engine refuses new requests itself)."""
        self._draining = True

    def engine(self) -> AsyncEngine:
        if self._engine is None:
            raise UnavailableError("the model is still loading")
        return self._engine

    @unary_errors
    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        with self._observer.track("Generate", context) as call:
            engine = self.engine()
            domain_request = convert.request_from_pb(request, pipeline_tag=engine.info.pipeline_tag)
            validated = call.validated(await engine.validate(domain_request, stream=False))
            result = call.finished(await engine.generate(validated))
            return convert.generate_response_to_pb(result, details=convert.wants_details(request))

    @unary_errors
    async def CompatGenerate(self, request: pb.GenerateRequest,
                             context: Context) -> pb.CompatGenerateResponse:
        with self._observer.track("CompatGenerate", context) as call:
            engine = self.engine()
            domain_request = convert.request_from_pb(request, compat_route=True,
                                                    pipeline_tag=engine.info.pipeline_tag)
            validated = call.validated(await engine.validate(domain_request, stream=False))
            result = call.finished(await engine.generate(validated))
            response = convert.generate_response_to_pb(result, details=convert.wants_details(request))
            return pb.CompatGenerateResponse(responses=[response])

    @stream_errors
    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: Context) -> AsyncIterator[pb.StreamResponse]:
        with self._observer.track("GenerateStream", context) as call:
            engine = self.engine()
            domain_request = convert.request_from_pb(request, pipeline_tag=engine.info.pipeline_tag)
            validated = call.validated(await engine.validate(domain_request, stream=True))
            details, num_sent = convert.wants_details(request), 0
            async with (contextlib.aclosing(engine.generate_stream(validated)) as outputs,
                        contextlib.aclosing(with_keepalives(outputs, requested_interval(context))) as events):
                async for output in events:
                    if output is None:
                        yield pb.StreamResponse(keep_alive=True)
                        continue
                    call.streamed(output)
                    responses = convert.stream_responses_to_pb(output, first_index=num_sent + 1, details=details)
                    for response in responses:
                        yield response
                    num_sent += len(responses)

    @unary_errors
    async def Tokenize(self, request: pb.GenerateRequest, context: Context) -> pb.TokenizeResponse:
        return convert.tokenize_response_to_pb(await self.engine().tokenize(request.inputs))

    @unary_errors
    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.InfoResponse:
        engine = self.engine()
        return convert.info_to_pb(engine.info, self._scheduler, engine.stats())

    @unary_errors
    async def Health(self, request: pb.HealthRequest, context: Context) -> httpbody_pb2.HttpBody:
        self.engine()
        if self._draining:
            raise UnavailableError("the server is shutting down")
        return httpbody_pb2.HttpBody()

    @unary_errors
    async def Metrics(self, request: pb.MetricsRequest, context: Context) -> httpbody_pb2.HttpBody:
        content_type, body = await asyncio.to_thread(self._metrics)  # milliseconds: not on the event loop
        return httpbody_pb2.HttpBody(content_type=content_type, data=body)

    @unary_errors
    async def OpenApi(self, request: pb.OpenApiRequest, context: Context) -> httpbody_pb2.HttpBody:
        return httpbody_pb2.HttpBody(content_type=docs.OPENAPI_CONTENT_TYPE, data=docs.openapi_document())

    @unary_errors
    async def Docs(self, request: pb.DocsRequest, context: Context) -> httpbody_pb2.HttpBody:
        found = await asyncio.to_thread(docs.docs_file, request.file)
        if found is None:
            raise NotFoundError(f"no such file: /docs/{request.file}")
        return httpbody_pb2.HttpBody(content_type=found[0], data=found[1])

    @unary_errors
    async def ListModels(self, request: pb.ListModelsRequest, context: Context) -> pb.ListModelsResponse:
        return convert.models_to_pb(self.engine().info.model_id)
