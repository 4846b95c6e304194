"""The gRPC server's own settings (the engine's are in `inference_service.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from inference_service.api.pings import MIN_PING_INTERVAL_S
from inference_service.observability.tracing import otlp_target


def read_pem(path: str, what: str) -> bytes:
    """A PEM file's bytes; a missing or unreadable file is a ValueError that names the flag."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{what} {path!r}: {error.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {path!r} is not a PEM file")
    return data


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
    # TLS on the gRPC port (PEM files): the server's certificate chain and key; with a client CA,
    # mutual TLS (every caller presents a certificate that CA signed).
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    # The engine's scheduler and model in a child process (engine/core_process.py): a crash there ends
    # the calls in flight with UNAVAILABLE, where a crash of the whole server would cut them.
    engine_core_process: bool = True
    # Pings closer together than this cost a caller a strike (`api.pings`); tests shorten it.
    min_ping_interval_s: float = MIN_PING_INTERVAL_S

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def __post_init__(self) -> None:
        _require(0 <= self.grpc_port <= 65535, "--grpc-port must be in [0, 65535]")
        _require(self.payload_limit > 0, "--payload-limit must be > 0")
        _require(0 <= self.prometheus_port <= 65535, "--prometheus-port must be in [0, 65535]")
        if self.otlp_endpoint:
            otlp_target(self.otlp_endpoint)  # a ValueError that says what it should look like
        _require(self.min_ping_interval_s > 0, "the minimum ping interval must be > 0")
        _require(self.graceful_termination_timeout >= 0, "--graceful-termination-timeout must be >= 0")
        _require((self.tls_cert is None) == (self.tls_key is None), "--tls-cert and --tls-key go together")
        _require(
            self.tls_client_ca is None or self.tls_cert is not None,
            "--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key",
        )
        _require(
            self.log_level.lower() in ("debug", "info", "warning", "error"),
            f"--log-level must be debug, info, warning or error, not {self.log_level!r}",
        )
