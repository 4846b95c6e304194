"""Fixtures of the client tests: real servers (the tiny random Llama) on loopback ports.

Each server runs in this process on its own event-loop thread, the way `inference-service serve`
runs it (`ApiServer`: listen, load the engine, serve), so the client is tested over real gRPC
with real status details and real cancellation.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

HOST = "127.0.0.1"
# Enough KV for a few concurrent requests of the tiny model; small, so leaks show in the count.
KV_TOKENS = 2048
BLOCK_SIZE = 4


def free_port() -> int:
    """A port nothing listens on now (the OS may hand it out again later; tests use it at once)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def engine_config(model_dir, max_concurrent_requests: int = 16):
    # The server is imported here, not at the top: the pure client tests don't need torch.
    from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig

    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir)),
        cache=CacheConfig(block_size=BLOCK_SIZE, max_batch_total_tokens=KV_TOKENS),
        limits=LimitsConfig(max_concurrent_requests=max_concurrent_requests),
    )


class ServerThread:
    """An `ApiServer` serving on its own event loop thread; `start()` returns once it serves."""

    def __init__(self, config, port: int = 0):
        self._config = config
        self._port = port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-server", daemon=True)
        self.server = None
        self.port: int | None = None

    @property
    def target(self) -> str:
        return f"{HOST}:{self.port}"

    def _run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> ServerThread:
        self._thread.start()

        from inference_service.api.config import ServerConfig
        from inference_service.api.server import ApiServer

        async def start() -> int:
            self.server = ApiServer(ServerConfig(hostname=HOST, grpc_port=self._port), self._config)
            port = await self.server.start()
            await self.server.load_engine()
            return port

        self.port = self._run(start())
        return self

    def stop(self) -> None:
        if self.server is not None:
            self._run(self.server.shutdown(0.0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def stats(self):
        """The engine's stats (requests, KV blocks) as the server sees them now."""
        assert self.server is not None and self.server.engine is not None
        return self.server.engine.stats()

    def wait_idle(self, timeout: float = 10.0):
        """Wait until no request runs or waits and every KV block is free; returns the stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if idle and stats.num_free_blocks == stats.num_total_blocks:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.02)


@pytest.fixture(scope="session")
def server(tiny_model_dir) -> Iterator[ServerThread]:
    """The shared server (16 concurrent requests); tests must leave it idle."""
    thread = ServerThread(engine_config(tiny_model_dir)).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="session")
def busy_server(tiny_model_dir) -> Iterator[ServerThread]:
    """A server that takes one request at a time (`max_concurrent_requests=1`)."""
    thread = ServerThread(engine_config(tiny_model_dir, max_concurrent_requests=1)).start()
    yield thread
    thread.stop()
