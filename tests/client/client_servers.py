"""Servers for the client tests, each on its own event-loop thread in this process.

`ServerThread` is the real server (`ApiServer`, as `inference-service serve` runs it) on the tiny
random Llama. `ScriptedServer` answers TextGeneration calls with test functions, to check what
the client sends and how it reads answers the real server rarely gives (a generation failure, a
stream cut after a token); its errors are made by the server's own `abort`, so they carry the
real status details.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import grpc

HOST = "127.0.0.1"
# Enough KV for a few concurrent requests of the tiny model; small, so leaks show in the count.
KV_TOKENS = 2048
BLOCK_SIZE = 4
SERVICE = "textgen.v1.TextGeneration"


def free_port() -> int:
    """A port nothing listens on now (the OS may hand it out again later; tests use it at once)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def engine_config(model_dir, max_concurrent_requests: int = 16):
    # Imported here, not at the top: the pure client tests don't need torch.
    from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig

    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir)),
        cache=CacheConfig(block_size=BLOCK_SIZE, max_batch_total_tokens=KV_TOKENS),
        limits=LimitsConfig(max_concurrent_requests=max_concurrent_requests),
    )


class LoopThread:
    """An event loop on a daemon thread; `run` executes a coroutine there and waits."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


class ServerThread:
    """The real server on the tiny model; `start()` returns once it serves."""

    def __init__(self, config, port: int = 0):
        self._config = config
        self._port = port
        self._loop: LoopThread | None = None
        self.server = None
        self.port: int | None = None

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def start(self) -> ServerThread:
        from inference_service.api.config import ServerConfig
        from inference_service.api.server import ApiServer

        async def start() -> int:
            self.server = ApiServer(ServerConfig(hostname=HOST, grpc_port=self._port), self._config)
            port = await self.server.start()
            await self.server.load_engine()
            return port

        self._loop = LoopThread("test-server")
        self.port = self._loop.run(start())
        return self

    def shutdown(self, timeout_s: float = 0.0) -> None:
        """Drain as on SIGTERM: in-flight requests get `timeout_s`, then are cancelled."""
        if self.server is not None and self._loop is not None:
            self._loop.run(self.server.shutdown(timeout_s))
            self.server = None

    def stop(self) -> None:
        self.shutdown()
        if self._loop is not None:
            self._loop.stop()

    def stats(self):
        """The engine's stats (requests, KV blocks) as the server sees them now."""
        return self.server.engine.stats()

    def wait_idle(self, timeout: float = 10.0):
        """Wait until no request runs or waits and every KV block is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if (idle and stats.num_free_blocks == stats.num_total_blocks) or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)


class ScriptedServer:
    """A grpc.aio server whose TextGeneration methods are the given async functions.

    `handlers` maps a method name ("Generate", "GenerateStream", "ChatCompletionStream", ...) to
    `fn(request, context)` (an async generator for the streaming methods). Every call's metadata
    is kept in `calls`.
    """

    def __init__(self, handlers: dict[str, Callable], credentials: grpc.ServerCredentials | None = None):
        from textgen.v1 import generate_pb2 as pb

        self._credentials = credentials
        self.calls: list[tuple[str, dict[str, str]]] = []
        messages = {
            "Generate": (pb.GenerateRequest, pb.GenerateResponse),
            "GenerateStream": (pb.GenerateRequest, pb.StreamResponse),
            "Tokenize": (pb.GenerateRequest, pb.TokenizeResponse),
            "Info": (pb.InfoRequest, pb.InfoResponse),
            "ChatCompletionStream": (pb.ChatCompletionRequest, pb.ChatCompletionChunk),
            "CompletionStream": (pb.CompletionRequest, pb.CompletionResponse),
        }
        self._rpc_handlers = {}
        for name, fn in handlers.items():
            request_cls, response_cls = messages[name]
            make = (
                grpc.unary_stream_rpc_method_handler if name.endswith("Stream") else grpc.unary_unary_rpc_method_handler
            )
            self._rpc_handlers[name] = make(
                self._recorded(name, fn),
                request_deserializer=request_cls.FromString,
                response_serializer=response_cls.SerializeToString,
            )
        self._loop = LoopThread("scripted-server")
        self.port = self._loop.run(self._start())

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def _recorded(self, name: str, fn: Callable) -> Callable:
        def record(context) -> None:
            self.calls.append((name, {key: value for key, value in context.invocation_metadata()}))

        if name.endswith("Stream"):

            async def stream(request, context):
                record(context)
                async for response in fn(request, context):
                    yield response

            return stream

        async def unary(request, context):
            record(context)
            return await fn(request, context)

        return unary

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, self._rpc_handlers),))
        if self._credentials is not None:
            port = self._server.add_secure_port(f"{HOST}:0", self._credentials)
        else:
            port = self._server.add_insecure_port(f"{HOST}:0")
        await self._server.start()
        return port

    def stop(self) -> None:
        self._loop.run(self._server.stop(None))
        self._loop.stop()
