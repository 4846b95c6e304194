"""OpenTelemetry traces, exported over OTLP/gRPC when `--otlp-endpoint` is set; nothing otherwise.

Off (the default), no OpenTelemetry module is even imported. On:
- a TracerProvider of our own (not the global one, so several servers can share a process) with
  `service.name = --otlp-service-name`, the SDK's default sampler (parent-based, always on: the
  caller's sampling decision is kept) and a BatchSpanProcessor, so exporting never blocks serving;
  a collector that is down costs failed exports on the processor's thread, and spans are dropped
  once its queue is full;
- the gRPC server span per RPC comes from opentelemetry-instrumentation-grpc's aio interceptor,
  which continues the caller's W3C `traceparent` from the call metadata (Envoy forwards its own);
- per generation request, spans are made afterwards from the engine's timings (explicit start and
  end times): `validation`, `queued` and `inference`, children of the server span. Milestones are
  events on `inference` (first token, each preemption); the prefill happens inside `inference`, so
  the prompt tokens reused from the prefix cache are an attribute there (OpenTelemetry's
  `gen_ai.usage.cache_read.input_tokens`); there is never a span per token or step;
- health checks, metrics scrapes and reflection are not traced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from inference_service.outputs import RequestTimings

logger = logging.getLogger(__name__)

TRACER_NAME = "inference_service"
# Probes, scrapes and reflection would flood a trace store with spans nobody reads.
UNTRACED_SERVICES = (
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
)
UNTRACED_METHODS = ("/textgen.v1.TextGeneration/Health", "/textgen.v1.TextGeneration/Metrics")
SHUTDOWN_WAIT_S = 5.0  # what the last export may add to a shutdown when the collector is slow or down


def otlp_target(endpoint: str) -> tuple[str, int, bool]:
    """(host, port, tls) of an OTLP/gRPC endpoint: `http://host:4317`, `https://host`, `host:port`."""
    parts = urlsplit(endpoint if "://" in endpoint else f"http://{endpoint}")
    if parts.scheme not in ("http", "https", "grpc", "grpcs") or not parts.hostname:
        raise ValueError(f"--otlp-endpoint must look like http://host:4317, not {endpoint!r}")
    tls = parts.scheme in ("https", "grpcs")
    return parts.hostname, parts.port or (443 if tls else 4317), tls


@dataclass
class RequestTrace:
    """What one generation request's engine spans are made of (monotonic perf_counter seconds)."""

    started: float
    validated: float | None = None
    ended: float | None = None
    num_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    sequences: Sequence[Any] = ()  # per engine request: (timings, generated tokens, finish reason)
    error: str | None = None  # the failure kind (tgi_request_failure's `err`)
    adapter_id: str | None = None  # the LoRA adapter serving it; None: the base model


class Tracing:
    """An OTLP-exporting tracer provider, the gRPC server interceptor and our engine spans."""

    def __init__(self, endpoint: str, service_name: str):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as error:
            raise RuntimeError(
                "--otlp-endpoint needs the observability extra (pip install 'inference-service[observability]')"
            ) from error
        host, port, tls = otlp_target(endpoint)
        self.endpoint = endpoint
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        exporter = OTLPSpanExporter(endpoint=target, insecure=not tls, timeout=SHUTDOWN_WAIT_S)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer(TRACER_NAME)
        logger.info("exporting traces to %s as %s", endpoint, service_name)

    def server_interceptors(self) -> list[Any]:
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=self.provider, filter_=_traced)]

    @staticmethod
    def current_context() -> Any:
        from opentelemetry import context

        return context.get_current()

    @staticmethod
    def trace_id(parent: Any) -> str | None:
        from opentelemetry import trace

        span_context = trace.get_current_span(parent).get_span_context()
        return f"{span_context.trace_id:032x}" if span_context.is_valid else None

    def record(self, parent: Any, request: RequestTrace) -> None:
        """The engine spans of one finished (or failed) request, under `parent`'s span."""
        from opentelemetry.trace import Status, StatusCode

        clock = _Clock()
        if request.validated is not None:
            span = self.tracer.start_span(
                "validation",
                context=parent,
                start_time=clock.ns(request.started),
                attributes=_drop_none(
                    {
                        "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                        "gen_ai.request.max_tokens": request.max_new_tokens,
                        "textgen.lora_adapter": request.adapter_id,
                    }
                ),
            )
            span.end(end_time=clock.ns(request.validated))
        else:
            if request.error == "validation":
                span = self.tracer.start_span("validation", context=parent, start_time=clock.ns(request.started))
                span.set_status(Status(StatusCode.ERROR, "validation"))
                span.end(end_time=clock.ns(request.ended or request.started))
            return
        for index, (timings, num_generated, finish_reason) in enumerate(request.sequences):
            self._record_sequence(
                parent,
                clock,
                request,
                timings,
                num_generated,
                finish_reason,
                index if len(request.sequences) > 1 else None,
            )

    def _record_sequence(
        self,
        parent: Any,
        clock: _Clock,
        request: RequestTrace,
        timings: RequestTimings,
        num_generated: int | None,
        finish_reason: str | None,
        index: int | None,
    ) -> None:
        from opentelemetry.trace import Status, StatusCode

        if timings.finished is None:
            return
        failed = Status(StatusCode.ERROR, request.error) if request.error else None
        common = {"textgen.best_of.index": index, "textgen.lora_adapter": request.adapter_id}
        queued_from = request.validated if request.validated is not None else timings.queued or timings.arrival
        queued = self.tracer.start_span(
            "queued", context=parent, start_time=clock.ns(queued_from), attributes=_drop_none(common)
        )
        if timings.first_scheduled is None:  # it ended in the queue (cancelled, failed)
            if failed:
                queued.set_status(failed)
            queued.end(end_time=clock.ns(timings.finished))
            return
        queued.end(end_time=clock.ns(timings.first_scheduled))
        sizes = timings.batch_sizes
        attributes = _drop_none(
            {
                **common,
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                "gen_ai.usage.output_tokens": num_generated,
                "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else None,
                "textgen.num_steps": len(sizes),
                "textgen.batch_sizes": sorted(set(sizes)) if sizes else None,
                "textgen.batch_size.max": max(sizes) if sizes else None,
                "textgen.batch_size.mean": sum(sizes) / len(sizes) if sizes else None,
                "textgen.num_preemptions": timings.num_preemptions,
                # Prompt tokens whose K/V came from the prefix cache: the prefill computed only the rest.
                "gen_ai.usage.cache_read.input_tokens": timings.num_cached_tokens,
            }
        )
        inference = self.tracer.start_span(
            "inference", context=parent, start_time=clock.ns(timings.first_scheduled), attributes=attributes
        )
        if timings.first_token is not None:
            inference.add_event("first_token", timestamp=clock.ns(timings.first_token))
        for number, moment in enumerate(timings.preempted_at, start=1):
            inference.add_event("preempted", {"textgen.preemption": number}, timestamp=clock.ns(moment))
        if failed:
            inference.set_status(failed)
        inference.end(end_time=clock.ns(timings.finished))

    def shutdown(self) -> None:
        """Export what is left, waiting at most SHUTDOWN_WAIT_S (a dead collector must not hold us)."""
        done = threading.Thread(target=self.provider.shutdown, name="otlp-shutdown", daemon=True)
        done.start()
        done.join(SHUTDOWN_WAIT_S)
        if done.is_alive():
            logger.warning("traces not all exported to %s within %.0fs", self.endpoint, SHUTDOWN_WAIT_S)


def _traced(call_details: Any) -> bool:
    method = call_details.method or ""
    method = method.decode() if isinstance(method, bytes) else method
    return method not in UNTRACED_METHODS and method.lstrip("/").partition("/")[0] not in UNTRACED_SERVICES


class _Clock:
    """perf_counter seconds → Unix nanoseconds (what span times are), from one reading of both."""

    def __init__(self):
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def ns(self, moment: float) -> int:
        return int(moment * 1e9) + self._offset_ns


def _drop_none(attributes: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in attributes.items() if value is not None}
