"""The gRPC server: TextGeneration, grpc.health.v1 and reflection on one port, and the engine's life.

The port opens before the model loads, so orchestrators see NOT_SERVING while it loads and warms
up, SERVING once it can generate, and NOT_SERVING again while it drains on SIGTERM (readiness); the
`liveness` health service is SERVING all along, for a liveness probe that must not kill a pod that
is loading or draining. Once drained (or failed), the port stays open while requests still arrive,
each refused before admission (`linger`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from inference_service.api import linger, pings
from inference_service.api.auth import ApiKeyInterceptor
from inference_service.api.config import ServerConfig, read_pem
from inference_service.api.decoding import DecodeErrorInterceptor, WholeMessageInterceptor
from inference_service.api.header_limits import metadata_options
from inference_service.api.loop_lag import watch_loop_lag
from inference_service.api.servicer import TextGenerationServicer
from inference_service.api.stopping import LOAD_THREAD, StopSignals, abandon_loading
from inference_service.config import EngineConfig
from inference_service.engine import core_client
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.gc_pauses import GcClock, freeze_loaded_objects
from inference_service.engine.host_heap import cap_arenas
from inference_service.frontend.front_end import FrontEnd
from inference_service.observability.hub import Observability
from textgen.v1 import generate_pb2, generate_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name
HEALTH_SERVICES = ("", SERVICE_NAME)  # "" is the whole server
# SERVING as long as the process answers, loading and draining included: what a liveness probe asks
# (the services above say whether to send requests, which is readiness).
LIVENESS_SERVICE = "liveness"
# `serve`'s exit status once the engine can no longer generate (a model shard died).
EXIT_ENGINE_FAILED = 1
# After the engine drained, handlers only have their last messages to send.
STOP_GRACE_S = 5.0

T = TypeVar("T")


class StartupError(Exception):
    """The server could not start (port taken, bad address); the message says why."""


class ApiServer:
    """One grpc.aio server for one engine: start, load the engine, shut down gracefully."""

    def __init__(
        self,
        server_config: ServerConfig,
        engine_config: EngineConfig,
        load_engine: Callable[[EngineConfig], AsyncEngine] = AsyncEngine.from_config,
    ):
        self.config = server_config
        self._engine_config = engine_config
        self._load_engine = load_engine
        self.engine: AsyncEngine | None = None
        self.front_end: FrontEnd | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.gc_clock: GcClock | None = None
        self._loop_lag: asyncio.Future | None = None
        self.observability = Observability(server_config)
        self.servicer = TextGenerationServicer(
            engine_config.scheduler, metrics=self.observability.metrics.render, observer=self.observability.requests
        )
        self.health = HealthServicer()
        # Set when the engine can no longer generate (a model shard died): NOT_SERVING, and `serve` exits.
        self.failed = asyncio.Event()
        self._failure_watch: asyncio.Future | None = None
        self._not_serving_since: float | None = None  # time.monotonic() once the engine failed
        # First: every unary request is read as a stream, where a call that ends without a message shows.
        interceptors: list[grpc.aio.ServerInterceptor] = [WholeMessageInterceptor()]
        interceptors += self.observability.server_interceptors()
        if server_config.api_key:
            interceptors.append(ApiKeyInterceptor(server_config.api_key))
        interceptors.append(DecodeErrorInterceptor())  # last: it wraps the servicer's own handlers
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                *metadata_options(),  # what Envoy forwards always fits (api/header_limits.py)
                ("grpc.max_receive_message_length", server_config.payload_limit),
                ("grpc.so_reuseport", 0),  # a port in use is an error, not a silent second listener
                *pings.server_options(server_config.min_ping_interval_s),
            ],
        )
        generate_pb2_grpc.add_TextGenerationServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self._server,
        )

    @property
    def address(self) -> str:
        host = self.config.hostname
        return f"[{host}]" if ":" in host and not host.startswith("[") else host

    async def start(self) -> int:
        """Listen (NOT_SERVING until `load_engine`); returns the bound port."""
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        target = f"{self.address}:{self.config.grpc_port}"
        try:
            credentials = server_credentials(self.config)
            if credentials is None:
                self.port = self._server.add_insecure_port(target)
            else:
                self.port = self._server.add_secure_port(target, credentials)
        except ValueError as error:
            raise StartupError(str(error)) from None
        except RuntimeError as error:
            raise StartupError(f"cannot listen on {target}: {error}") from None
        await self._server.start()
        logger.info(
            "gRPC API listening on %s:%d%s",
            self.address,
            self.port,
            (" (mutual TLS)" if self.config.tls_client_ca else " (TLS)") if self.config.tls else "",
        )
        self.metrics_port = self.observability.start_metrics_port(self.config.hostname, self.config.prometheus_port)
        return self.port

    async def load_engine(self) -> AsyncEngine:
        """Load, warm up and start the engine (off the event loop), then report SERVING."""
        logger.info("loading model %s", self._engine_config.model.model_id)
        engine = await run_in_daemon_thread(self._load_engine, self._engine_config)
        model = self._engine_config.model
        front_end = FrontEnd.for_engine(
            engine,
            model.chat_template,
            reasoning_parser=model.reasoning_parser,
            tool_call_parser=model.tool_call_parser,
        )
        self.observability.attach(engine)
        engine.start()
        self.engine, self.front_end = engine, front_end
        self.servicer.attach(engine, front_end)
        freeze_loaded_objects()  # full collections skip what loading made (engine/gc_pauses.py)
        if self.gc_clock is None:  # a long collection, a late event loop: every call stalls (logged)
            self.gc_clock = GcClock()
            self._loop_lag = asyncio.ensure_future(watch_loop_lag(self.gc_clock))
        for service in HEALTH_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._failure_watch = asyncio.ensure_future(self._watch_failure(engine))
        logger.info("serving %s", engine.info.model_id)
        return engine

    async def _watch_failure(self, engine: AsyncEngine) -> None:
        """Once the engine can no longer generate: NOT_SERVING for good (liveness too: restart me)."""
        reason = await engine.wait_failed()
        logger.error("not serving any more: %s", reason)
        for service in (*HEALTH_SERVICES, LIVENESS_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._not_serving_since = time.monotonic()
        self.failed.set()

    async def shutdown(self, timeout_s: float | None = None, cut: asyncio.Event | None = None) -> None:
        """NOT_SERVING, stop admitting, give in-flight requests `timeout_s` (or until `cut` is set:
        a second stop signal), cancel the rest, stop."""
        timeout_s = self.config.graceful_termination_timeout if timeout_s is None else timeout_s
        if self._failure_watch is not None and not self.failed.is_set():
            self._failure_watch.cancel()
        logger.info("draining (up to %.1fs; Ctrl-C again stops at once)", timeout_s)
        for service in HEALTH_SERVICES:  # not ready; still alive
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        not_serving_since = self._not_serving_since or time.monotonic()
        self.servicer.drain()
        if self.engine is not None:
            num_cut = await self.engine.shutdown(timeout_s, cut)
            at_once = cut is not None and cut.is_set()
            if num_cut or at_once:
                how = "stopped at once" if at_once else f"the drain timed out after {timeout_s:.1f}s"
                logger.info("%s: %d request%s cut", how, num_cut, "" if num_cut == 1 else "s")
            engine = self.engine  # refusing, typed, what a gateway still sends (api/linger.py)
            await linger.until_callers_stop(lambda: engine.last_arrival_at, not_serving_since, cut)
        await self._server.stop(STOP_GRACE_S)
        self._stop_stall_reports()
        await asyncio.to_thread(self.observability.shutdown)
        logger.info("stopped")

    async def stop_now(self) -> None:
        await self._server.stop(None)
        self._stop_stall_reports()
        await asyncio.to_thread(self.observability.shutdown)

    def _stop_stall_reports(self) -> None:
        if self._loop_lag is not None:
            self._loop_lag.cancel()
        if self.gc_clock is not None:
            self.gc_clock.close()


async def run_in_daemon_thread(function: Callable[..., T], *args: object) -> T:
    """Run a blocking call on a daemon thread: unlike the default executor, a SIGTERM while it runs
    (a model still loading) does not have to wait for it before the process can exit
    (`stopping.leave` then ends the process without the interpreter's shutdown)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def target() -> None:
        try:
            outcome = functools.partial(future.set_result, function(*args))
        except BaseException as error:  # handed to the awaiting coroutine
            outcome = functools.partial(future.set_exception, error)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=target, name=LOAD_THREAD, daemon=True).start()
    return await future


def engine_loader(server_config: ServerConfig, engine_config: EngineConfig) -> Callable[[EngineConfig], AsyncEngine]:
    """How `serve` and `launch` load the engine: in an engine-core process (--engine-core-process,
    the default; forked here, so call this before the server starts a thread) unless the config
    keeps it in this one (core_client.refusal)."""
    if not server_config.engine_core_process:
        return AsyncEngine.from_config
    return core_client.loader_for(engine_config)


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from the configured PEM files (None: plaintext); requires client
    certificates signed by the client CA when one is given."""
    if not config.tls:
        return None
    key, chain = read_pem(config.tls_key, "--tls-key"), read_pem(config.tls_cert, "--tls-cert")
    client_ca = read_pem(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


async def serve(server_config: ServerConfig, engine_config: EngineConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain (a second signal cuts the drain short); returns
    the exit code. Raises ModelLoadError (the model can't be served) or StartupError (can't listen)."""
    cap_arenas()  # before the server's threads: grammar compiles must not fragment a heap each
    server = ApiServer(server_config, engine_config, engine_loader(server_config, engine_config))
    signals = StopSignals.install()
    await server.start()
    loading = asyncio.ensure_future(server.load_engine())
    stopping = asyncio.ensure_future(signals.stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and loading.exception() is not None:
        stopping.cancel()
        await server.stop_now()
        raise loading.exception()
    if not loading.done():  # stopped while loading: nothing is in flight
        loading.cancel()
        abandon_loading()
        await server.stop_now()
        logger.info("stopped (%s) while the model was loading", signals.name)
        return 0
    failing = asyncio.ensure_future(server.failed.wait())
    await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
    if failing.done():  # as TGI's launcher when a shard crashes: stop, and exit with an error
        stopping.cancel()
        await server.shutdown(timeout_s=0.0)
        logger.error("exiting: the model can no longer run")
        return EXIT_ENGINE_FAILED
    failing.cancel()
    await server.shutdown(cut=signals.now)
    return 0
