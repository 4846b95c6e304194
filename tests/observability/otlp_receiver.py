"""A real OTLP/gRPC trace receiver, in process: the collector's own service definition
(`opentelemetry.proto.collector.trace.v1.TraceService`), keeping every span it is sent."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

SERVICE = "textgen-test"  # the traced test servers' --otlp-service-name


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@dataclass
class ReceivedSpan:
    """One exported span, flattened for assertions (ids as hex)."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    events: list = field(default_factory=list)  # (name, time_ns, attributes)
    status_code: int = 0


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Listens on 127.0.0.1:<free port>; `endpoint` is what --otlp-endpoint takes."""

    def __init__(self):
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 — the service's method name
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=resource.get("service.name", ""),
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in span.attributes},
                            events=[
                                (e.name, e.time_unix_nano, {kv.key: _value(kv.value) for kv in e.attributes})
                                for e in span.events
                            ],
                            status_code=span.status.code,
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 20.0) -> dict[str, list[ReceivedSpan]]:
        """The trace's spans by name, once every name in `names` has arrived (or the timeout passed)."""
        deadline = time.monotonic() + timeout
        while True:
            by_name: dict[str, list[ReceivedSpan]] = {}
            for span in self.trace(trace_id):
                by_name.setdefault(span.name, []).append(span)
            if names <= set(by_name) or time.monotonic() > deadline:
                return by_name
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.stop(None)
