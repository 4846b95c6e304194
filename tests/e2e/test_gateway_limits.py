"""The gateway's own behaviour: body size limit (413 JSON), CORS, health while the model loads and
when the server is gone, gRPC errors that arrive before any message, and what one caller may hold
(gateway/limits.py): slow and idle connections time out while others are served, a full gateway
refuses connections at once instead of hanging, large headers get 431, gRPC's content type on a
REST route 415."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import threading
import urllib.request

import grpc
import pytest
from rest_helpers import sse_events, status_and_body

from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

PAYLOAD_LIMIT = 4096


@pytest.fixture(scope="module")
def limited(tiny_grpc_server, start_gateway):
    return start_gateway(tiny_grpc_server, payload_limit=PAYLOAD_LIMIT, cors_allow_origin=("https://app.example",))


@pytest.mark.parametrize("path", ["/generate", "/", "/generate_stream"])
def test_bodies_over_the_payload_limit_get_413_json(limited, validate, path):
    body = {"inputs": "x" * PAYLOAD_LIMIT, "parameters": {"max_new_tokens": 1}}
    status, headers, raw = status_and_body(limited.curl(path, "-i", body=body))
    error = json.loads(raw)
    validate(error, "ErrorResponse")
    assert (status, error["error_type"]) == (413, "payload_too_large")
    assert headers["content-type"] == "application/json"


def test_the_limit_is_on_requests_not_answers(limited):
    inputs = "the quick brown fox " * (PAYLOAD_LIMIT // 25)
    answer = limited.curl("/tokenize", body={"inputs": inputs})
    assert len(answer) > PAYLOAD_LIMIT and len(json.loads(answer)) > 100


def test_cors_allows_the_configured_origin_only(limited):
    preflight = (
        "-X",
        "OPTIONS",
        "-H",
        "Access-Control-Request-Method: POST",
        "-H",
        "Access-Control-Request-Headers: content-type",
    )
    _, headers, _ = status_and_body(limited.curl("/generate", "-i", *preflight, "-H", "Origin: https://app.example"))
    assert headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in headers["access-control-allow-methods"]
    _, headers, _ = status_and_body(limited.curl("/generate", "-i", *preflight, "-H", "Origin: https://evil.example"))
    assert "access-control-allow-origin" not in headers
    _, headers, _ = status_and_body(limited.curl("/info", "-i", "-H", "Origin: https://app.example"))
    assert headers["access-control-allow-origin"] == "https://app.example"


def test_cors_allows_any_origin_by_default(gateway):
    _, headers, _ = status_and_body(gateway.curl("/info", "-i", "-H", "Origin: https://anywhere.example"))
    assert headers["access-control-allow-origin"] == "https://anywhere.example"


def test_while_the_model_loads(tiny_engine_config, start_grpc_server, start_gateway, validate):
    """Before the engine is attached every RPC answers UNAVAILABLE: REST gets TGI's 503 shapes."""
    loading = start_gateway(start_grpc_server(tiny_engine_config, load=False))
    status, _, body = status_and_body(loading.curl("/health", "-i"))
    assert (status, json.loads(body)) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
    status, _, body = status_and_body(loading.curl("/generate", "-i", body={"inputs": "x"}))
    error = json.loads(body)
    validate(error, "ErrorResponse")
    assert (status, error["error_type"]) == (503, "unavailable")
    status, _, body = status_and_body(loading.curl("/generate_stream", "-i", body={"inputs": "x"}))
    [event] = sse_events(body)
    assert status == 200 and event["error_type"] == "unavailable"


def test_when_the_server_is_gone(tiny_engine_config, start_grpc_server, start_gateway, validate):
    server = start_grpc_server(tiny_engine_config, load=False)
    orphan = start_gateway(server)
    server.stop(timeout_s=0)
    status, _, body = status_and_body(orphan.curl("/health", "-i"))
    assert (status, json.loads(body)) == (503, {"error": "unhealthy", "error_type": "healthcheck"})
    status, _, body = status_and_body(orphan.curl("/generate", "-i", body={"inputs": "x"}))
    error = json.loads(body)
    validate(error, "ErrorResponse")
    assert (status, error["error_type"]) == (503, "unavailable")


# -- what one caller may hold ----------------------------------------------------------------------
PARTIAL_HEADERS = b"POST /generate HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
GENERATE_ONE = {"inputs": "hello", "parameters": {"max_new_tokens": 1}}


@contextlib.contextmanager
def open_files(count: int):
    """This process may hold `count` more descriptors (its soft limit raised, restored after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(soft, count + 1024)  # what pytest, torch and the server hold already fits in 1024
    if hard != resource.RLIM_INFINITY and wanted > hard:
        pytest.skip(f"the hard open-file limit ({hard}) is too low for {count} sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def slow_callers(port: int, count: int) -> list[socket.socket]:
    """`count` connections that send the start of a request's headers and then nothing."""
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        with contextlib.suppress(OSError):  # over the cap Envoy may close it before this is sent
            sock.sendall(PARTIAL_HEADERS)
        sockets.append(sock)
    return sockets


def what_each_got(sockets: list[socket.socket]) -> list[bytes]:
    """Each connection's bytes until Envoy closed it (b"" for a close without an answer)."""
    answers = []
    for sock in sockets:
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(4096):
                received += chunk
        answers.append(received)
        sock.close()
    return answers


def bystanders_served(gateway) -> None:
    status, _, body = status_and_body(gateway.curl("/health", "-i", timeout=30))
    assert status == 200, body
    status, _, body = status_and_body(gateway.curl("/generate", "-i", body=GENERATE_ONE, timeout=30))
    assert status == 200 and json.loads(body)["generated_text"] is not None, body


def test_slow_callers_time_out_while_others_are_served(tiny_grpc_server, start_gateway):
    """2000 connections stuck in their headers: /health and /generate are served beside them, and
    each of them gets a 408 once its headers are overdue (they were held forever before)."""
    gateway = start_gateway(tiny_grpc_server, request_headers_timeout_s=2)
    with open_files(2100):
        stuck = slow_callers(gateway.envoy.port, 2000)
        bystanders_served(gateway)
        answers = what_each_got(stuck)
    assert all(answer.startswith(b"HTTP/1.1 408") for answer in answers), {a[:40] for a in answers}
    assert b'"error_type":"request_timeout"' in answers[0]
    bystanders_served(gateway)


def test_a_body_that_never_ends_times_out_but_a_long_answer_does_not(tiny_grpc_server, start_gateway):
    """The request timeout covers receiving a request, never waiting for its answer."""
    gateway = start_gateway(tiny_grpc_server, request_timeout_s=0.2)
    with socket.create_connection(("127.0.0.1", gateway.envoy.port), timeout=30) as sock:
        sock.sendall(PARTIAL_HEADERS + b"Content-Length: 100\r\n\r\n{")
        (answer,) = what_each_got([sock])
    assert answer.startswith(b"HTTP/1.1 408"), answer
    # Longer than the request timeout to answer, and silent until then.
    long = {"inputs": "hello", "parameters": {"max_new_tokens": 400, "details": True}}
    status, _, body = status_and_body(gateway.curl("/generate", "-i", body=long, timeout=60))
    assert status == 200 and json.loads(body)["details"]["generated_tokens"] == 400, body


def test_a_full_gateway_refuses_connections_at_once_and_recovers(tiny_grpc_server, start_gateway):
    """Envoy with 600 descriptors: its connection cap is below that (gateway/limits.py), so 1000
    stuck callers fill the cap and the ones over it are closed at once (before, Envoy ran out of
    descriptors: new connections hung and nothing reached the engine); once the stuck callers
    time out the gateway serves again."""
    from gateway.envoy import Envoy

    server = tiny_grpc_server
    gateway = start_gateway(server, request_headers_timeout_s=2)
    envoy = Envoy(gateway.envoy.config, gateway.envoy.workdir / "small", open_files=600)
    assert envoy.config.max_connections < 600
    envoy.start()
    try:
        from tests.e2e.conftest import Gateway

        small = Gateway(envoy, server)
        limits = open(f"/proc/{envoy.pid}/limits").read()  # noqa: SIM115 - read at once
        assert [line.split()[3] for line in limits.splitlines() if line.startswith("Max open files")] == ["600"]
        with open_files(1100):
            stuck = slow_callers(envoy.port, 1000)
            answers = what_each_got(stuck)
        refused = [answer for answer in answers if answer == b""]
        timed_out = [answer for answer in answers if answer.startswith(b"HTTP/1.1 408")]
        # Every one ended: closed at once when over the cap, else answered 408 when overdue (those
        # the kernel queued until Envoy had room again included).
        assert len(refused) + len(timed_out) == 1000 and refused and timed_out
        stat = f"/stats?filter=_{envoy.port}.downstream_global_cx_overflow$"
        with urllib.request.urlopen(envoy.admin_url + stat, timeout=10) as response:
            overflows = response.read().decode()
        assert int(overflows.rsplit(": ", 1)[1]) == len(refused), overflows
        bystanders_served(small)
    finally:
        envoy.stop()


@pytest.mark.parametrize("size", [12_000, 20_000, 30_000])
def test_headers_within_the_limit_reach_the_engine(gateway, size):
    """Up to 32 KiB: served (the engine refused over 8 KiB at random and over 16 KiB always: 429)."""
    status, _, body = status_and_body(gateway.curl("/generate", "-i", "-H", f"x-big: {'a' * size}", body=GENERATE_ONE))
    assert status == 200, body


def test_headers_over_the_limit_get_431_and_health_stays_200(gateway):
    for path, body in (("/generate", GENERATE_ONE), ("/generate_stream", GENERATE_ONE), ("/health", None)):
        status, _, text = status_and_body(gateway.curl(path, "-i", "-H", f"x-big: {'a' * 40_000}", body=body))
        assert status == 431 and json.loads(text)["error_type"] == "validation", text
    many = [arg for i in range(120) for arg in ("-H", f"x-h{i}: {i}")]
    status, _, text = status_and_body(gateway.curl("/generate", "-i", *many, body=GENERATE_ONE))
    assert status == 431, text
    assert status_and_body(gateway.curl("/health", "-i"))[0] == 200


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/v1/chat/completions", "/health"])
def test_grpcs_content_type_on_a_rest_route_gets_415(gateway, path):
    """A JSON body sent as application/grpc went to the engine as a gRPC call to no method: 503
    "unreachable", its JSON error inside another."""
    body = () if path == "/health" else ("-d", json.dumps(GENERATE_ONE))
    raw = gateway.curl(path, "-i", "-H", "Content-Type: application/grpc", *body)
    status, headers, text = status_and_body(raw)
    error = json.loads(text)
    assert status == 415 and headers["content-type"] == "application/json"
    message = error["error"]["message"] if path.startswith("/v1/") else error["error"]
    assert "Content-Type: application/json" in message and "{" not in message, message
    assert not any(name.startswith("grpc-") for name in headers)


def test_grpc_callers_still_use_the_same_port(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.envoy.port}") as channel:
        reply = generate_pb2_grpc.TextGenerationStub(channel).Generate(
            pb.GenerateRequest(inputs="hello", parameters=pb.GenerateParameters(max_new_tokens=2)), timeout=30
        )
    assert reply.generated_text


@pytest.mark.soak
def test_thousands_of_idle_and_slow_callers_beside_generations(tiny_grpc_server, start_gateway):
    """`pytest -m soak tests/e2e/test_gateway_limits.py`: 8000 connections (silent, stuck in their
    headers, or in their body) held open while 20 generations and health checks run beside them."""
    gateway = start_gateway(tiny_grpc_server, request_headers_timeout_s=10, request_timeout_s=10)
    with open_files(8200):
        held = slow_callers(gateway.envoy.port, 4000)
        for _ in range(2000):
            held.append(socket.create_connection(("127.0.0.1", gateway.envoy.port), timeout=60))
        for sock in slow_callers(gateway.envoy.port, 2000):
            sock.sendall(b"Content-Length: 100\r\n\r\n{")
            held.append(sock)
        failures: list[str] = []

        def bystander() -> None:
            try:
                bystanders_served(gateway)
            except AssertionError as error:
                failures.append(str(error))

        threads = [threading.Thread(target=bystander) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert failures == []
        answers = what_each_got(held)
    assert all(answer == b"" or answer.startswith(b"HTTP/1.1 408") for answer in answers)
    bystanders_served(gateway)
