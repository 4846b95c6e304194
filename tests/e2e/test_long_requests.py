"""A request runs once and finishes, however long it takes: through the real Envoy (REST unary and
streamed, gRPC through Envoy) and straight to the engine (the typed client), while every hop pings.

Here Envoy and the typed client ping every `PING_S`, the engine permits that, and a test-only knob
slows each engine step down, so a request outlasts many ping intervals within seconds. An engine
that polices pings as gRPC does by default closes such a connection in a second or two: the last
tests show that happen, and that the request cut after admission is not replayed, while a refusal
before admission (a loading engine) is retried.

The soak test does it for real: five-minute requests with the shipped settings, through `launch`
with one engine, with two replicas and with TLS, over REST, the typed client and the OpenAI SDK.
It runs only when asked (about 6 minutes): `pytest -m soak tests/e2e/test_long_requests.py`.
"""

from __future__ import annotations

import json
import ssl
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rest_helpers import sse_events

from gateway.replicas import free_port
from inference_service.api.errors import RETRYABLE_KEY
from inference_service.engine.async_engine import STEP_DELAY_ENV
from tests.certs import make_certs
from tests.conftest import GrpcServerThread
from textgen.v1 import generate_pb2 as pb
from textgen_client import Client, RetryPolicy, UnavailableError

PING_S = 0.2  # Envoy's pings in the fast tests
PERMITTED_S = 0.05  # the engine takes pings this often
# The typed client's: gRPC sends a client's pings at most once a second, whatever it is told.
CLIENT_PINGS = (("grpc.keepalive_time_ms", 1000),)
STEP_DELAY_MS = 20
TOKENS = 400  # from "a", the tiny model never stops early: 400 steps of at least 20 ms
BODY = {"inputs": "a", "parameters": {"max_new_tokens": TOKENS, "details": True}}
TIMEOUT = 120


@pytest.fixture(scope="module")
def slow_steps():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(STEP_DELAY_ENV, str(STEP_DELAY_MS))
        yield


@pytest.fixture(scope="module")
def pinged(slow_steps, tiny_engine_config, start_gateway):
    """An engine that permits pings every PERMITTED_S, behind an Envoy that pings every PING_S."""
    server = GrpcServerThread(tiny_engine_config, min_ping_interval_s=PERMITTED_S)
    yield start_gateway(server, upstream_ping_interval_s=PING_S)
    server.stop(timeout_s=1.0)


@pytest.fixture(scope="module")
def strict(slow_steps, tiny_engine_config, start_gateway):
    """An engine with gRPC's default ping policy (5 minutes without data), behind the same Envoy."""
    server = GrpcServerThread(tiny_engine_config, min_ping_interval_s=300)
    yield start_gateway(server, upstream_ping_interval_s=PING_S)
    server.stop(timeout_s=1.0)


@pytest.fixture(scope="module")
def loading(tiny_engine_config, start_gateway):
    """An engine whose model never finishes loading: it refuses every request before admission."""
    server = GrpcServerThread(tiny_engine_config, load=False)
    yield start_gateway(server)
    server.stop(timeout_s=0.0)


def post(url: str, body: dict, context: ssl.SSLContext | None = None) -> tuple[int, str]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT * 10, context=context) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def scrape(server) -> dict:
    text = server.stub.Metrics(pb.MetricsRequest(), timeout=10).data.decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def moved(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (f"{name}_total", tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def rest_unary(url: str, context: ssl.SSLContext | None = None, path: str = "/generate") -> str:
    status, body = post(url + path, BODY, context)
    assert status == 200, body
    answer = json.loads(body)
    answer = answer[0] if isinstance(answer, list) else answer  # `POST /` answers a list
    assert answer["details"]["generated_tokens"] == TOKENS and answer["details"]["finish_reason"] == "length"
    return answer["generated_text"]


def rest_stream(url: str, context: ssl.SSLContext | None = None) -> str:
    status, body = post(url + "/generate_stream", BODY, context)
    assert status == 200, body
    events = sse_events(body.replace(":\n\n", ""))  # TGI's keep-alive comments aside
    assert [e["index"] for e in events] == list(range(1, TOKENS + 1)), events[-1]
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]
    return events[-1]["generated_text"]


def client_unary(target: str, options=(), **settings) -> str:
    with Client(target, timeout=None, channel_options=options, **settings) as client:
        response = client.generate("a", max_new_tokens=TOKENS)
    assert response.details.generated_tokens == TOKENS
    return response.generated_text


def client_stream(target: str, options=(), **settings) -> str:
    with Client(target, timeout=None, channel_options=options, **settings) as client:
        messages = list(client.generate_stream("a", max_new_tokens=TOKENS))
    assert [m.index for m in messages] == list(range(1, TOKENS + 1))
    return messages[-1].generated_text


def run_all(calls: dict) -> dict:
    """Every call at once (they share the engine's batches); their results by name."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: future.result() for name, future in futures.items()}


def test_long_requests_finish_once_on_every_hop(pinged):
    target = pinged.url.removeprefix("http://")
    before, started = scrape(pinged.server), time.monotonic()
    texts = run_all(
        {
            "REST": lambda: rest_unary(pinged.url),
            "REST stream": lambda: rest_stream(pinged.url),
            "gRPC through Envoy": lambda: client_unary(target, CLIENT_PINGS),
            "gRPC stream through Envoy": lambda: client_stream(target, CLIENT_PINGS),
            "gRPC direct": lambda: client_unary(pinged.server.target, CLIENT_PINGS),
        }
    )
    elapsed, after = time.monotonic() - started, scrape(pinged.server)
    assert elapsed > 8 * dict(CLIENT_PINGS)["grpc.keepalive_time_ms"] / 1000  # the premise: many pings each
    assert len(set(texts.values())) == 1 and next(iter(texts.values())), texts  # the same whole text
    # Each generated once: five requests, five successes, nothing failed or replayed.
    assert moved(before, after, "tgi_request_count") == moved(before, after, "tgi_request_success") == len(texts)
    assert not any(moved(before, after, "tgi_request_failure", err=kind) for kind in ("dropped", "unavailable"))


def test_a_refusal_before_admission_is_retried(loading):
    before = scrape(loading.server)
    status, body = post(loading.url + "/generate", BODY)
    assert status == 503 and json.loads(body)["error_type"] == "unavailable", body
    status, body = post(loading.url + "/generate_stream", BODY)  # TGI: an in-band error event
    assert status == 200 and sse_events(body)[-1]["error_type"] == "unavailable", body
    status, body = post(loading.url + "/v1/completions", {"prompt": "a", "max_tokens": 3, "stream": True})
    assert status == 503, body
    after = scrape(loading.server)
    # Each refused at the engine, then tried twice more (Envoy's retries): nothing ran.
    assert moved(before, after, "tgi_request_count") == moved(before, after, "tgi_request_failure", err="unavailable")
    assert moved(before, after, "tgi_request_count") == 3 * 3


def test_the_typed_client_retries_a_refusal_before_admission(loading):
    before = scrape(loading.server)
    retry = RetryPolicy(max_retries=2, initial_backoff=0.01)
    with Client(loading.server.target, retry=retry) as client, pytest.raises(UnavailableError, match="loading"):
        client.generate("a", max_new_tokens=3)
    assert moved(before, scrape(loading.server), "tgi_request_count") == 3


def test_envoys_503_is_retryable_only_when_no_engine_was_reached(start_gateway):
    nowhere = start_gateway(SimpleNamespace(port=free_port("127.0.0.1")))  # nothing listens there
    request = urllib.request.Request(nowhere.url + "/generate", data=json.dumps(BODY).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=TIMEOUT)
    assert refused.value.code == 503 and refused.value.headers[RETRYABLE_KEY] == "1"
    with Client(nowhere.url, retry=RetryPolicy(max_retries=0)) as client, pytest.raises(UnavailableError) as caught:
        client.generate("a")
    assert caught.value.retryable  # so the typed client would try again


def test_a_request_cut_after_admission_is_not_replayed(strict):
    """The bug this file guards against: an engine that refuses Envoy's pings closes the connection
    under a running request. The caller sees the failure; the request is not run again."""
    before = scrape(strict.server)
    status, body = post(strict.url + "/generate", BODY)
    assert status == 503, body
    retry = RetryPolicy(max_retries=3, initial_backoff=0.01)
    with pytest.raises(UnavailableError):
        client_unary(strict.server.target, CLIENT_PINGS, retry=retry)  # gRPC direct: the same
    after = scrape(strict.server)
    assert moved(before, after, "tgi_request_count") == 2  # once each
    assert moved(before, after, "tgi_request_success") == 0


# -- soak: five minutes with the shipped settings ---------------------------------------------------
SOAK_STEP_DELAY_MS = 800  # 400 steps: over 5 minutes
SOAK_TOKENS = 400
START_S = 600  # three launches at once on a busy machine


def _soak_calls(url: str, context: ssl.SSLContext | None, engine_port: int | None) -> dict:
    """The calls the soak test makes on one launch: REST unary (`POST /`) and streamed, and, without
    TLS, the typed client through Envoy (and to the engine's own port, given one) and the OpenAI SDK."""
    body = {"inputs": "a", "parameters": {"max_new_tokens": SOAK_TOKENS, "details": True}}

    def unary() -> tuple[str, int]:
        status, text = post(url + "/", body, context)
        assert status == 200, text
        return "CompatGenerate", json.loads(text)[0]["details"]["generated_tokens"]

    def stream() -> tuple[str, int]:
        status, text = post(url + "/generate_stream", body, context)
        assert status == 200, text
        events = sse_events(text.replace(":\n\n", ""))
        assert events[-1]["generated_text"] is not None, events[-1]
        return "GenerateStream", len(events)

    calls = {"REST": unary, "REST stream": stream}
    if context is None:
        target = url.removeprefix("http://")

        def typed(to: str) -> tuple[str, int]:
            with Client(to, timeout=None) as client:
                return "Generate", client.generate("a", max_new_tokens=SOAK_TOKENS).details.generated_tokens

        def sdk(stream: bool) -> tuple[str, int]:
            sdk_client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=900)
            settings = {"model": "tiny", "prompt": "a", "max_tokens": SOAK_TOKENS, "temperature": 0}
            if not stream:
                return "Completion", sdk_client.completions.create(**settings).usage.completion_tokens
            chunks = list(
                sdk_client.completions.create(**settings, stream=True, stream_options={"include_usage": True})
            )
            return "CompletionStream", chunks[-1].usage.completion_tokens

        calls.update(
            {
                "typed client through Envoy": lambda: typed(target),
                "OpenAI SDK": lambda: sdk(stream=False),
                "OpenAI SDK stream": lambda: sdk(stream=True),
            }
        )
    if engine_port is not None:  # one engine: its own gRPC port too
        calls["typed client direct"] = lambda: typed(f"127.0.0.1:{engine_port}")
    return calls


@pytest.mark.soak
def test_five_minute_requests_finish_once_with_default_settings(launched, tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_DELAY_ENV, str(SOAK_STEP_DELAY_MS))  # the launches' engines inherit it
    certs = make_certs(tmp_path)
    tls = ssl.create_default_context(cafile=str(certs.ca))
    runs = {
        "one engine": launched(),
        "two replicas": launched("--num-replicas", "2"),
        "TLS": launched("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)),
    }
    one = runs["one engine"].wait_for(r"ready: TGI REST API on (\S+), gRPC API on port (\d+)", timeout_s=START_S)
    replicas = runs["two replicas"].wait_for(r"ready: TGI REST API on (\S+) \(gRPC too\)", timeout_s=START_S)
    secure = runs["TLS"].wait_for(r"ready: TGI REST API on (https://[^\s,]+)", timeout_s=START_S)
    calls = {
        **{f"one engine: {n}": c for n, c in _soak_calls(one.group(1), None, int(one.group(2))).items()},
        **{f"two replicas: {n}": c for n, c in _soak_calls(replicas.group(1), None, None).items()},
        **{
            f"TLS: {n}": c for n, c in _soak_calls(secure.group(1).replace("127.0.0.1", "localhost"), tls, None).items()
        },
    }
    started = time.monotonic()
    results = run_all(calls)
    assert time.monotonic() - started > 300  # the premise: requests of over five minutes
    assert {name: tokens for name, (_, tokens) in results.items()} == dict.fromkeys(calls, SOAK_TOKENS)
    for label, run in runs.items():
        # One request log line per call, each "ok": nothing failed, nothing ran twice.
        sent = Counter(method for name, (method, _) in results.items() if name.startswith(label + ":"))
        logged = Counter(m.group(1) for m in run.matches(r"\b(\w+) (?:ok|failed \(\w+\))\b") if m.group(1) in sent)
        assert logged == sent, f"{label}:\n{run.log()[-3000:]}"
        assert not run.matches(r"\bfailed \(\w+\)"), run.log()[-3000:]
