"""The observability of one server (traces, metrics, request logs), built from its settings.

It reads two of them, named by `TracingSettings`, which the server's `ServerConfig` has: the
arrow runs from the server to here, never back.

`ApiServer` owns one `Observability`: its interceptors go into the gRPC server, its request
observer and metrics renderer into the servicer, its step observer into the engine, and the
metrics port opens next to the gRPC port.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

from inference_service.observability.metrics import ServerMetrics
from inference_service.observability.metrics_server import MetricsServer
from inference_service.observability.requests import RequestObserver

if TYPE_CHECKING:
    from inference_service.engine.async_engine import AsyncEngine
    from inference_service.observability.tracing import Tracing

logger = logging.getLogger(__name__)


class TracingSettings(Protocol):
    """What the hub reads of the server's settings (`api.config.ServerConfig` has both)."""

    @property
    def otlp_endpoint(self) -> str | None: ...

    @property
    def otlp_service_name(self) -> str: ...


class Observability:
    """Metrics always; tracing when `otlp_endpoint` is set."""

    def __init__(self, config: TracingSettings):
        self.metrics = ServerMetrics()
        self.tracing: Tracing | None = None
        if config.otlp_endpoint:
            from inference_service.observability.tracing import Tracing

            self.tracing = Tracing(config.otlp_endpoint, config.otlp_service_name)
        self.requests = RequestObserver(self.metrics, self.tracing)
        self._metrics_server: MetricsServer | None = None
        self._tracing_closed = False

    def server_interceptors(self) -> list[Any]:
        return self.tracing.server_interceptors() if self.tracing is not None else []

    def start_metrics_port(self, host: str, port: int) -> int | None:
        """Serve the metrics on host:port; the bound port, or None when it can't be bound (logged:
        the `Metrics` RPC and the gateway's GET /metrics still serve them)."""
        try:
            self._metrics_server = MetricsServer(host, port, self.metrics.render)
        except OSError as error:
            logger.warning(
                "metrics port %s:%d unavailable (%s); metrics stay available through the Metrics "
                "RPC (GET /metrics on the gateway)",
                host,
                port,
                error.strerror or error,
            )
            return None
        logger.info("Prometheus metrics on %s:%d", host, self._metrics_server.port)
        return self._metrics_server.port

    def attach(self, engine: AsyncEngine) -> None:
        """The engine is loaded: feed its steps and state into the metrics."""
        self.metrics.attach(engine.info, engine.stats)
        engine.observe_steps(self.metrics.on_step)

    def shutdown(self) -> None:
        """Close the metrics port and export the last spans (bounded wait); blocking."""
        if self._metrics_server is not None:
            self._metrics_server.stop()
            self._metrics_server = None
        if self.tracing is not None and not self._tracing_closed:
            self._tracing_closed = True
            self.tracing.shutdown()
