"""What the client sends and how it reads rare answers, against a scripted gRPC server.

The errors are made by the real server's `abort` (status code, ErrorInfo, `x-error-type`), so
the client reads exactly what the real server would send for them.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import grpc
import pytest
from client_servers import ScriptedServer, free_port

from inference_service.api.errors import abort
from inference_service.errors import GenerationError as ServerGenerationError
from inference_service.errors import InferenceError, RequestCancelled
from inference_service.errors import UnavailableError as ServerUnavailable
from textgen.v1 import generate_pb2 as pb
from textgen_client import (
    AsyncClient,
    AuthenticationError,
    CancelledError,
    Client,
    GenerationError,
    IncompleteGenerationError,
    OverloadedError,
    RetryPolicy,
    UnavailableError,
    UnimplementedError,
    UnknownError,
)

FAST_RETRY = RetryPolicy(max_retries=3, initial_backoff=0.01, max_backoff=0.05)


def _token(index: int) -> pb.StreamResponse:
    return pb.StreamResponse(index=index, token=pb.Token(id=index, text=f"t{index}", logprob=-1.0))


async def _echo_generate(request, context):
    deadline = context.time_remaining()
    return pb.GenerateResponse(generated_text=f"{request.inputs}|{deadline:.3f}")


@pytest.fixture
def scripted():
    servers: list[ScriptedServer] = []

    def make(credentials=None, **handlers) -> ScriptedServer:
        servers.append(ScriptedServer(handlers, credentials))
        return servers[-1]

    yield make
    for server in servers:
        server.stop()


def test_api_key_metadata_and_deadline_reach_the_server(scripted):
    server = scripted(Generate=_echo_generate)
    with Client(server.target, api_key="sk-123", metadata={"X-Tenant": "blue"}, timeout=7.0) as client:
        text = client.generate("hi", metadata=[("x-call", "1")]).generated_text
        short = client.generate("hi", timeout=2.0).generated_text
    sent = server.calls[0][1]
    assert sent["authorization"] == "Bearer sk-123"
    assert sent["x-tenant"] == "blue" and sent["x-call"] == "1"
    assert sent["user-agent"].startswith("textgen-client/")
    assert "x-call" not in server.calls[1][1]
    assert 6.0 < float(text.split("|")[1]) <= 7.1  # the client's default timeout is the deadline
    assert 1.0 < float(short.split("|")[1]) <= 2.1  # a per-call timeout wins


def test_trace_context_of_the_calling_thread_is_sent(scripted):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    server = scripted(Generate=_echo_generate)
    with Client(server.target) as client:
        client.generate("no span")
        with tracer.start_as_current_span("caller") as span:
            client.generate("in a span")  # runs on the client's loop thread: the context must travel
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert "traceparent" not in server.calls[0][1]
    assert server.calls[1][1]["traceparent"].split("-")[1] == trace_id


async def test_trace_context_async(scripted):
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("test")
    server = scripted(GenerateStream=_two_tokens_then_final)
    async with AsyncClient(server.target) as client:
        with tracer.start_as_current_span("caller") as span:
            _ = [r async for r in client.generate_stream("x")]
    assert server.calls[0][1]["traceparent"].split("-")[1] == f"{span.get_span_context().trace_id:032x}"


async def _two_tokens_then_final(request, context):
    yield _token(1)
    final = _token(2)
    final.generated_text = "t1t2"
    yield final


@pytest.mark.parametrize(
    ("error", "expected", "kind"),
    [
        (ServerGenerationError("CUDA out of memory"), GenerationError, "generation"),
        (RequestCancelled("server shutting down"), CancelledError, "cancelled"),
        (InferenceError("boom"), UnknownError, "internal"),
        (RuntimeError("a bug"), UnknownError, "internal"),
    ],
)
def test_server_errors_become_typed_errors(scripted, error, expected, kind):
    async def fail(request, context):
        await abort(context, error, "Generate")

    server = scripted(Generate=fail)
    with Client(server.target) as client, pytest.raises(expected) as caught:
        client.generate("x")
    assert caught.value.error_type == kind
    if isinstance(error, InferenceError):
        assert str(error) in caught.value.message
    else:  # a server bug: its text goes to the server's log, never to the caller
        assert caught.value.message == "Unexpected server error"


def test_refused_credentials_and_missing_methods(scripted):
    async def refuse(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad api key")

    server = scripted(Generate=refuse)
    with Client(server.target, api_key="wrong") as client:
        with pytest.raises(AuthenticationError, match="bad api key"):
            client.generate("x")
        with pytest.raises(UnimplementedError):
            client.info()


def test_unavailable_is_retried_until_it_serves(scripted):
    async def flaky(request, context):
        if len(server.calls) < 3:
            await abort(context, ServerUnavailable("the model is still loading"), "Generate")
        return pb.GenerateResponse(generated_text="ok")

    server = scripted(Generate=flaky)
    with Client(server.target, retry=FAST_RETRY) as client:
        assert client.generate("x").generated_text == "ok"
    assert len(server.calls) == 3
    with Client(server.target, retry=RetryPolicy(max_retries=0)) as client:
        server.calls.clear()
        with pytest.raises(UnavailableError, match="still loading"):
            client.generate("x")
    assert len(server.calls) == 1


def test_overloaded_is_not_retried(scripted):
    async def busy(request, context):
        from inference_service.errors import OverloadedError as ServerOverloaded

        await abort(context, ServerOverloaded(), "Generate")

    server = scripted(Generate=busy)
    with Client(server.target, retry=FAST_RETRY) as client, pytest.raises(OverloadedError):
        client.generate("x")
    assert len(server.calls) == 1


def test_a_stream_cut_after_a_token_is_not_retried(scripted):
    async def cut(request, context):
        yield _token(1)
        await abort(context, ServerUnavailable("draining"), "GenerateStream")

    server = scripted(GenerateStream=cut)
    received = []
    with Client(server.target, retry=FAST_RETRY) as client, pytest.raises(UnavailableError):
        for response in client.generate_stream("x"):
            received.append(response.token.text)
    assert received == ["t1"]  # no token twice
    assert len(server.calls) == 1


def test_a_stream_without_its_final_message_is_incomplete(scripted):
    async def short(request, context):
        yield _token(1)

    server = scripted(GenerateStream=short)
    with Client(server.target) as client, pytest.raises(IncompleteGenerationError):
        list(client.generate_stream("x"))


async def test_inband_stream_errors_are_raised(scripted):
    async def inband(request, context):
        yield _token(1)
        yield pb.StreamResponse(error="Model is overloaded", error_type="overloaded")

    server = scripted(GenerateStream=inband)
    async with AsyncClient(server.target) as client:
        with pytest.raises(OverloadedError, match="overloaded"):
            _ = [r async for r in client.generate_stream("x")]


async def test_no_server_async():
    client = AsyncClient(f"127.0.0.1:{free_port()}", retry=FAST_RETRY)
    with pytest.raises(UnavailableError) as caught:
        await client.generate("x")
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert await client.health() is False
    await client.close()


def test_sync_client_from_inside_a_running_loop(scripted):
    """The blocking client works in code that is itself run by an event loop (e.g. a notebook)."""
    server = scripted(Generate=_echo_generate)

    async def inside() -> str:
        with Client(server.target) as client:
            return client.generate("nested").generated_text

    assert asyncio.run(inside()).startswith("nested|")


def test_calls_are_spread_over_replicas(scripted):
    first, second = scripted(Generate=_echo_generate), scripted(Generate=_echo_generate)
    with Client(f"ipv4:{first.target},{second.target}") as client:
        for _ in range(10):
            client.generate("x")
    assert len(first.calls) >= 2 and len(second.calls) >= 2
    assert len(first.calls) + len(second.calls) == 10


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> tuple[bytes, bytes]:
    """(certificate, key) of a self-signed certificate for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(folder / "key.pem"),
            "-out",
            str(folder / "cert.pem"),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return (folder / "cert.pem").read_bytes(), (folder / "key.pem").read_bytes()


def test_tls_with_own_credentials(scripted, self_signed):
    certificate, key = self_signed
    server = scripted(Generate=_echo_generate, credentials=grpc.ssl_server_credentials([(key, certificate)]))
    trusted = grpc.ssl_channel_credentials(root_certificates=certificate)
    with Client(server.target, credentials=trusted, api_key="sk-tls") as client:
        assert client.generate("secret").generated_text.startswith("secret|")
    assert server.calls[0][1]["authorization"] == "Bearer sk-tls"
    # The system's roots don't trust it, and a plaintext client can't talk to it.
    for options in ({"tls": True}, {}):
        client = Client(server.target, retry=RetryPolicy(max_retries=0), timeout=5, **options)
        with client, pytest.raises(UnavailableError):
            client.generate("x")
