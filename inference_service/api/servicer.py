"""The TextGeneration servicer: one gRPC service composed of its API surfaces.

TGI's routes (`tgi.TgiRoutes`), OpenAI's (`openai.OpenAIRoutes`), the Responses API's
(`responses.ResponsesRoutes`) and Anthropic's (`anthropic.AnthropicRoutes`) share one `Backend` (the engine
and its front end once loaded, and the request observer); the servicer hands each RPC to its
surface and answers the service's own calls here (info, health, metrics, the OpenAPI document, docs,
the model list).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import prometheus_client
from google.api import httpbody_pb2

from inference_service.api import convert, docs
from inference_service.api.anthropic import AnthropicRoutes
from inference_service.api.backend import Backend
from inference_service.api.errors import unary_errors
from inference_service.api.openai import OpenAIRoutes
from inference_service.api.responses import ResponsesRoutes
from inference_service.api.tgi import TgiRoutes
from inference_service.config import SchedulerConfig
from inference_service.engine import lora_control
from inference_service.engine.async_engine import AsyncEngine
from inference_service.errors import (
    ECHO_CHARS,
    NotFoundError,
    ServerFailed,
    UnavailableError,
    ValidationError,
    shortened,
)
from inference_service.frontend.front_end import FrontEnd
from inference_service.models.lora_registry import AdapterInfo
from inference_service.observability.requests import RequestObserver
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

Context = grpc.aio.ServicerContext
# (content type, body) of the Metrics RPC; the observability layer plugs its registry in here.
MetricsRenderer = Callable[[], tuple[str, bytes]]


def render_prometheus_registry() -> tuple[str, bytes]:
    body = prometheus_client.generate_latest(prometheus_client.REGISTRY)
    return prometheus_client.CONTENT_TYPE_LATEST, body


class TextGenerationServicer(generate_pb2_grpc.TextGenerationServicer):
    """textgen.v1.TextGeneration over one engine (attached once the model is loaded)."""

    def __init__(
        self,
        scheduler: SchedulerConfig,
        metrics: MetricsRenderer = render_prometheus_registry,
        observer: RequestObserver | None = None,
    ):
        self._scheduler = scheduler
        self._metrics = metrics
        self._backend = Backend(observer)
        self._draining = False
        tgi, openai = TgiRoutes(self._backend), OpenAIRoutes(self._backend)
        # Each RPC is its surface's method; grpc looks them up on this object.
        self.Generate, self.CompatGenerate = tgi.Generate, tgi.CompatGenerate
        self.GenerateStream, self.Tokenize = tgi.GenerateStream, tgi.Tokenize
        self.ChatCompletion, self.ChatCompletionStream = openai.ChatCompletion, openai.ChatCompletionStream
        self.Completion, self.CompletionStream = openai.Completion, openai.CompletionStream
        self.GetModel = openai.GetModel
        anthropic = AnthropicRoutes(self._backend)
        self.Messages, self.MessagesStream = anthropic.Messages, anthropic.MessagesStream
        self.CountMessageTokens = anthropic.CountMessageTokens
        responses = ResponsesRoutes(self._backend)
        self.CreateResponse, self.CreateResponseStream = responses.CreateResponse, responses.CreateResponseStream
        self.GetResponse, self.DeleteResponse = responses.GetResponse, responses.DeleteResponse

    def attach(self, engine: AsyncEngine, front_end: FrontEnd) -> None:
        self._backend.attach(engine, front_end)

    def drain(self) -> None:
        """Shutting down: Health answers UNAVAILABLE (the engine refuses new requests itself)."""
        self._draining = True

    @unary_errors
    async def Info(self, request: pb.InfoRequest, context: Context) -> pb.InfoResponse:
        engine = self._backend.engine()
        return convert.info_to_pb(engine.info, self._scheduler, engine.stats(), _adapters(engine))

    @unary_errors
    async def Health(self, request: pb.HealthRequest, context: Context) -> httpbody_pb2.HttpBody:
        engine = self._backend.engine()
        if engine.failure is not None:  # TGI's /health fails once a shard is gone
            raise ServerFailed(engine.failure)
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
            raise NotFoundError(f"no such file: /docs/{shortened(request.file, ECHO_CHARS)}")
        return httpbody_pb2.HttpBody(content_type=found[0], data=found[1])

    @unary_errors
    async def ListModels(self, request: pb.ListModelsRequest, context: Context) -> pb.ListModelsResponse:
        engine = self._backend.engine()
        return convert.models_to_pb(engine.info, _adapters(engine))

    @unary_errors
    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest, context: Context) -> pb.ModelCard:
        engine = self._backend.engine()
        if not request.lora_name or not request.lora_path:
            raise ValidationError("`lora_name` and `lora_path` are both required")
        adapter = await lora_control.load_adapter(engine, request.lora_name, request.lora_path)
        return convert.adapter_card(engine.info, adapter)

    @unary_errors
    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: Context
    ) -> pb.UnloadLoraAdapterResponse:
        engine = self._backend.engine()
        if not request.lora_name:
            raise ValidationError("`lora_name` is required")
        timeout_s = request.timeout_s if request.HasField("timeout_s") else lora_control.DEFAULT_UNLOAD_TIMEOUT_S
        if not 0 <= timeout_s <= 3600:
            raise ValidationError(f"`timeout_s` must be in [0, 3600]. Given: {timeout_s}")
        await lora_control.unload_adapter(engine, request.lora_name, timeout_s)
        return pb.UnloadLoraAdapterResponse(id=request.lora_name, object="model", deleted=True)


def _adapters(engine: AsyncEngine) -> list[AdapterInfo]:
    return engine.adapters.infos() if engine.adapters is not None else []
