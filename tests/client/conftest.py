"""Fixtures of the client tests: real servers on the tiny random Llama, on loopback ports."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from client_servers import ServerThread, engine_config


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


@pytest.fixture(scope="session")
def chat_server(tiny_chat_engine_config) -> Iterator[ServerThread]:
    """The tiny model with a ChatML template, for the OpenAI-style calls."""
    thread = ServerThread(tiny_chat_engine_config).start()
    yield thread
    thread.stop()
