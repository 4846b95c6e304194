"""The gRPC server's own settings (the engine's are in `inference_service.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inference_service.observability.tracing import otlp_target


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class ServerConfig:
    """Where and how the gRPC API listens, and how it shuts down."""

    hostname: str = "0.0.0.0"
    grpc_port: int = 50051  # 0 = any free port (logged once bound)
    payload_limit: int = 2_000_000  # bytes of one received message (TGI's body limit)
    graceful_termination_timeout: float = 90.0  # seconds in-flight requests get on SIGTERM
    json_output: bool = False
    log_level: str = "info"
    otlp_endpoint: str | None = None
    otlp_service_name: str = "inference-service"
    prometheus_port: int = 9000  # metrics listener on `hostname`; 0 = any free port
    api_key: str | None = field(default=None, repr=False)  # a secret: kept out of reprs and logs

    def __post_init__(self) -> None:
        _require(0 <= self.grpc_port <= 65535, "--grpc-port must be in [0, 65535]")
        _require(self.payload_limit > 0, "--payload-limit must be > 0")
        _require(0 <= self.prometheus_port <= 65535, "--prometheus-port must be in [0, 65535]")
        if self.otlp_endpoint:
            otlp_target(self.otlp_endpoint)  # a ValueError that says what it should look like
        _require(self.graceful_termination_timeout >= 0, "--graceful-termination-timeout must be >= 0")
        _require(self.log_level.lower() in ("debug", "info", "warning", "error"),
                 f"--log-level must be debug, info, warning or error, not {self.log_level!r}")
