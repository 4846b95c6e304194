"""A catalogue of hostile requests, by kind, for tests/e2e/test_hostile.py: each kind makes one case
from a seeded `random.Random`, so a seed list gives the same cases on every run (the fast subset
takes a few seeds per kind, the soak thousands).

A case sends itself to a running server (REST through Envoy, or gRPC to the engine directly or
through Envoy) and returns what came back; `problems` says what about an answer is wrong: a 5xx
(overload is a 429), a gRPC status that means a server bug, an error message longer than the
bound, or a stream that failed mid-generation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import random
import socket
import time
from collections.abc import Callable

import grpc
from google.protobuf import struct_pb2

from inference_service.api.errors import MAX_MESSAGE_BYTES
from tests.unit.test_grammar import chained_schema
from textgen.v1 import generate_pb2 as pb
from textgen.v1 import generate_pb2_grpc

TIMEOUT = 60
JSON = {"Content-Type": "application/json"}
# gRPC codes that tell a caller the server, not the request, is at fault.
SERVER_FAULT_CODES = {"UNKNOWN", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "?"}
_GRPC_CODES = {code.value[0]: code.name for code in grpc.StatusCode}
# In-band SSE error types a hostile stream may end with (a refusal, not a failure mid-generation).
STREAM_ERROR_TYPES = {"validation", "overloaded", "invalid_request_error", "overloaded_error"}


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the server listens: Envoy's port (REST and gRPC) and the engine's own gRPC port."""

    gateway_port: int
    grpc_port: int


@dataclasses.dataclass
class Answer:
    """What a case got: an HTTP status (0: the connection closed without one) or a gRPC status
    name, and the body (or the gRPC details)."""

    status: int | str
    body: bytes = b""
    via: str = "rest"


@dataclasses.dataclass(frozen=True)
class Case:
    kind: str
    name: str
    send: Callable[[Target], Answer]

    def __str__(self) -> str:
        return f"{self.kind}/{self.name}"


# -- sending -----------------------------------------------------------------------------------------
def rest(
    target: Target, path: str, body: bytes | dict | None, headers: dict | None = None, method: str = "POST"
) -> Answer:
    """One HTTP/1.1 request through Envoy; the whole answer (a stream read to its end)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    connection = http.client.HTTPConnection("127.0.0.1", target.gateway_port, timeout=TIMEOUT)
    try:
        connection.request(method, path, data, JSON if headers is None else headers)
        response = connection.getresponse()
        body = response.read()
        grpc_status = response.getheader("grpc-status")  # gRPC over HTTP/1.1 answers in headers
        if grpc_status is not None:
            name = _GRPC_CODES.get(int(grpc_status), "?") if grpc_status.isdigit() else "?"
            message = response.getheader("grpc-message") or ""
            return Answer(name, message.encode(), "grpc-http1")
        return Answer(response.status, body)
    except (ConnectionError, http.client.RemoteDisconnected):
        return Answer(0)
    finally:
        connection.close()


def raw_http(target: Target, data: bytes) -> Answer:
    """Bytes written to Envoy's port as they are; the answer's status (0: closed without one).
    A request the gateway still waits the rest of gets its write side closed after a second."""
    with socket.create_connection(("127.0.0.1", target.gateway_port), timeout=1) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        received = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                received += chunk
        if not received:
            sock.settimeout(TIMEOUT)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
                while chunk := sock.recv(65536):
                    received += chunk
    if not received.startswith(b"HTTP/"):
        return Answer(0, received[:200])
    head, _, body = received.partition(b"\r\n\r\n")
    return Answer(int(head.split()[1]), body)


def cancelled_rest_stream(target: Target, path: str, body: dict, events: int) -> Answer:
    """A stream read for `events` events, then the connection dropped."""
    connection = http.client.HTTPConnection("127.0.0.1", target.gateway_port, timeout=TIMEOUT)
    try:
        connection.request("POST", path, json.dumps(body), JSON)
        response = connection.getresponse()
        if response.status != 200:
            return Answer(response.status, response.read())
        for _ in range(events):
            if not response.readline():
                break
            response.readline()
        return Answer(200, b"(cancelled by the caller)")
    finally:
        if connection.sock is not None:
            connection.sock.close()
        connection.close()


_channels: dict[int, grpc.Channel] = {}


def channel(target: Target, through_gateway: bool) -> grpc.Channel:
    """One channel per port (and per process), reused as clients do: one HTTP/2 connection."""
    key = target.gateway_port if through_gateway else target.grpc_port
    if key not in _channels:
        _channels[key] = grpc.insecure_channel(
            f"127.0.0.1:{key}", options=[("grpc.max_send_message_length", 8 * 1024 * 1024)]
        )
    return _channels[key]


def grpc_call(target: Target, method: str, request, through_gateway: bool = False, cancel_after: int = -1) -> Answer:
    """A gRPC call with a message (or raw bytes); a stream is read to its end, or cancelled after
    `cancel_after` messages."""
    path = f"/textgen.v1.TextGeneration/{method}"
    chan = channel(target, through_gateway)
    data = request if isinstance(request, bytes) else request.SerializeToString()
    via = "grpc-gateway" if through_gateway else "grpc"
    streaming = method.endswith("Stream")
    invoke = (chan.unary_stream if streaming else chan.unary_unary)(path)
    try:
        result = invoke(data, timeout=TIMEOUT)
        if streaming:
            for count, _ in enumerate(result, 1):
                if count == cancel_after:
                    result.cancel()
                    return Answer("CANCELLED", b"(cancelled by the caller)", via)
        return Answer("OK", b"", via)
    except grpc.RpcError as error:
        code = error.code()
        return Answer(code.name if code else "UNKNOWN", (error.details() or "").encode(), via)


# -- judging ---------------------------------------------------------------------------------------
def error_message(body: bytes) -> str | None:
    """The message of a JSON error body (TGI's `{"error": ...}` or OpenAI's), or None."""
    try:
        document = json.loads(body)
    except ValueError:
        return None
    if not isinstance(document, dict) or "error" not in document:
        return None
    error = document["error"]
    return str(error.get("message") if isinstance(error, dict) else error)


def stream_errors(body: bytes) -> list[str]:
    """The error types of an SSE body's error events."""
    types = []
    for event in body.decode(errors="replace").split("\n\n"):
        data = [line for line in event.split("\n") if line.startswith("data: {")]  # Anthropic's: event + data
        if data:
            with contextlib.suppress(ValueError):
                document = json.loads(data[0][len("data: ") :])
                error = document.get("error")
                if error is not None:
                    types.append(
                        document.get("error_type") or (error.get("type") if isinstance(error, dict) else "") or "?"
                    )
    return types


def problems(answer: Answer) -> list[str]:
    """What is wrong with an answer to a hostile request (empty: it was handled as it should be)."""
    found = []
    if isinstance(answer.status, str):
        if answer.status in SERVER_FAULT_CODES:
            found.append(f"{answer.via} {answer.status}: {answer.body[:200]!r}")
        if len(answer.body) > MAX_MESSAGE_BYTES:
            found.append(f"{answer.via} details of {len(answer.body)} bytes")
        return found
    if answer.status >= 500:
        found.append(f"HTTP {answer.status}: {answer.body[:200]!r}")
    if answer.status >= 400:
        message = error_message(answer.body)
        if message is not None and len(message.encode()) > MAX_MESSAGE_BYTES:
            found.append(f"HTTP {answer.status} with a message of {len(message.encode())} bytes")
    if answer.status == 200:
        bad = [kind for kind in stream_errors(answer.body) if kind not in STREAM_ERROR_TYPES]
        if bad:
            found.append(f"a stream ended with error events {bad}: {answer.body[-300:]!r}")
    return found


# -- the kinds ---------------------------------------------------------------------------------------
def big(rng: random.Random, low: int = 60_000, high: int = 120_000) -> str:
    return rng.choice("xyz") * rng.randint(low, high)


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **fields}


def message(**fields) -> dict:
    """Anthropic's Messages shape."""
    return {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **fields}


def generate(**parameters) -> dict:
    return {"inputs": "Hello", "parameters": {"max_new_tokens": 3, **parameters}}


def post(path: str, body: dict | bytes, headers: dict | None = None) -> Callable[[Target], Answer]:
    return lambda target: rest(target, path, body, headers)


OPENAI_ROUTES = ["/v1/chat/completions", "/v1/completions"]


def tiny_temperature(rng: random.Random) -> Case:
    """Temperatures that overflowed the logits (and failed every row sampled in that step)."""
    value = rng.choice([1e-45, 5e-324, 1e-40, 1e-38, 1e-30, rng.uniform(0, 1e-20)])
    route = rng.choice(["/generate", "/generate_stream", *OPENAI_ROUTES, "/v1/messages", "grpc"])
    if route == "grpc":
        request = pb.GenerateRequest(
            inputs="Hello", parameters=pb.GenerateParameters(max_new_tokens=3, temperature=value, do_sample=True)
        )
        return Case("tiny_temperature", f"grpc-{value:g}", lambda t: grpc_call(t, "Generate", request))
    if route.startswith("/v1/chat"):
        body = chat(temperature=value, stream=rng.random() < 0.5)
    elif route == "/v1/messages":
        body = message(temperature=value, stream=rng.random() < 0.5)
    elif route == "/v1/completions":
        body = {"prompt": "Hello", "max_tokens": 3, "temperature": value}
    else:
        body = generate(temperature=value, do_sample=True)
    return Case("tiny_temperature", f"{route}-{value:g}", post(route, body))


# Numbers JSON may spell but Python's json would not write (the gateway's parser sees them raw).
RAW_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e308", "-1e308", "1e-45", "0", "-0.0", "1e38"]


def extreme_penalties(rng: random.Random) -> Case:
    """Penalties and filters at the ends of (and past) float range, NaN and infinities included."""
    raw = rng.choice(RAW_NUMBERS)
    if rng.random() < 0.5:
        field = rng.choice(["repetition_penalty", "frequency_penalty", "top_p", "typical_p", "top_k", "temperature"])
        text = f'{{"inputs":"Hello","parameters":{{"max_new_tokens":3,"do_sample":true,"{field}":{raw}}}}}'
        path = rng.choice(["/generate", "/generate_stream"])
    else:
        field = rng.choice(["frequency_penalty", "presence_penalty", "top_p", "temperature", "repetition_penalty"])
        text = f'{{"messages":[{{"role":"user","content":"hi"}}],"max_tokens":3,"{field}":{raw}}}'
        path = "/v1/chat/completions"
    return Case("extreme_penalties", f"{path}-{field}={raw}", post(path, text.encode()))


def echoed_input(rng: random.Random) -> Case:
    """A 60-120 KB value in a field that error messages quote: the message (and so the gRPC
    trailer) must stay short, or the shared Envoy → engine connection is reset."""
    value = big(rng)
    tool = {"type": "function", "function": {"name": value, "parameters": {"type": "object"}}}
    small_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    bodies = {
        "forced_bos_token": ("/generate", generate(forced_bos_token=value)),
        "regex": ("/generate", generate(grammar={"type": "regex", "value": "(" + value})),
        "grammar_type": ("/generate_stream", generate(grammar={"type": value, "value": "a"})),
        "logit_bias_key": ("/v1/chat/completions", chat(logit_bias={value: 1})),
        "tool_name_twice": ("/v1/chat/completions", chat(tools=[tool, tool])),
        "tool_choice": (
            "/v1/chat/completions",
            chat(tools=[small_tool], tool_choice={"type": "function", "function": {"name": value}}),
        ),
        "role": ("/v1/chat/completions", chat(messages=[{"role": value, "content": "hi"}])),
        "content_part": ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": value}]}])),
        "response_format_type": ("/v1/chat/completions", chat(response_format={"type": value})),
        "response_format_regex": (
            "/v1/chat/completions",
            chat(response_format={"type": "regex", "value": "[" + value}),
        ),
        "model": ("/v1/chat/completions", chat(model=value)),
        "stop": ("/generate", generate(stop=[value])),
        "stream_role": ("/v1/chat/completions", chat(stream=True, messages=[{"role": value, "content": "hi"}])),
        "completion_prompt_type": ("/v1/completions", {"prompt": [{"x": value}], "max_tokens": 3}),
        "messages_role": ("/v1/messages", message(messages=[{"role": value, "content": "hi"}])),
        "messages_block_type": ("/v1/messages", message(messages=[{"role": "user", "content": [{"type": value}]}])),
        "messages_tool_choice": ("/v1/messages", message(tool_choice={"type": "tool", "name": value})),
    }
    name = rng.choice(sorted(bodies))
    path, body = bodies[name]
    if name in ("forced_bos_token", "role", "regex") and rng.random() < 0.3:  # the same over gRPC directly
        request = {
            "forced_bos_token": pb.GenerateRequest(
                inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=2, forced_bos_token=value)
            ),
            "regex": pb.GenerateRequest(
                inputs="hi",
                parameters=pb.GenerateParameters(
                    max_new_tokens=2,
                    grammar=pb.Grammar(type="regex", value=struct_pb2.Value(string_value="(" + value)),
                ),
            ),
            "role": pb.ChatCompletionRequest(
                max_tokens=2, messages=[pb.ChatMessage(role=value, content=struct_pb2.Value(string_value="hi"))]
            ),
        }[name]
        method = "ChatCompletionStream" if name == "role" else "Generate"
        return Case("echoed_input", f"grpc-{name}", lambda t: grpc_call(t, method, request))
    return Case("echoed_input", name, post(path, body))


def hostile_grammar(rng: random.Random) -> Case:
    """Grammars that froze the engine loop or failed mid-generation: each must be refused at
    validation (within its compile budget) or complete."""
    grammars = {
        "chained_62_defs": ("json", chained_schema(62)),
        "nested_quantifiers": ("regex", "((a+)+)+b"),
        "counted_nested": ("regex", "((a{100}){100}){100}"),
        "a_million": ("regex", "a{1000000}"),
        "unclosed": ("regex", "(" * rng.randint(1, 5000)),
        "matches_nothing": ("regex", r"[^\s\S]"),
        "alternation_wide": ("regex", "|".join(f"w{i}x" for i in range(rng.randint(1000, 5000)))),
        "deep_schema": ("json", _nested_schema(rng.randint(100, 400))),
        "huge_enum": ("json", {"enum": [f"v{i}" for i in range(rng.randint(1000, 5000))]}),
        "self_ref": ("json", {"$ref": "#"}),
        "bad_schema": ("json", {"type": "no-such-type"}),
        "schema_pattern": ("json", {"type": "string", "pattern": "((a{50}){50}){50}"}),
    }
    name = rng.choice(sorted(grammars))
    kind, value = grammars[name]
    route = rng.choice(["tgi", "chat", "tools"] if kind == "json" else ["tgi", "chat"])
    if route == "tgi":
        return Case(
            "hostile_grammar", f"tgi-{name}", post("/generate", generate(grammar={"type": kind, "value": value}))
        )
    if route == "tools":
        tool = {"type": "function", "function": {"name": "f", "parameters": value}}
        return Case("hostile_grammar", f"tools-{name}", post("/v1/chat/completions", chat(tools=[tool])))
    if kind == "json":
        response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": value}}
    else:
        response_format = {"type": "regex", "value": value}
    return Case("hostile_grammar", f"chat-{name}", post("/v1/chat/completions", chat(response_format=response_format)))


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


GRPC_METHODS = ["Generate", "GenerateStream", "ChatCompletion", "ChatCompletionStream", "Completion", "Tokenize"]


def malformed_protobuf(rng: random.Random) -> Case:
    """Bytes that are no message of the method's type, to the engine directly or through Envoy."""
    shapes = {
        "random": lambda: rng.randbytes(rng.randint(1, 2000)),
        "length_past_end": lambda: b"\x0a\xff\xff\xff\xff\x0f",
        "truncated": lambda: pb.GenerateRequest(inputs="hello " * 20).SerializeToString()[: rng.randint(1, 100)],
        "bad_utf8_string": lambda: b"\x0a\x03\xc3\x28a",
        "bad_tag": lambda: b"\xff" * rng.randint(1, 20),
        "deep_group": lambda: b"\x0b" * rng.randint(100, 5000),  # start-group tags, never ended
    }
    shape = rng.choice(sorted(shapes))
    data = shapes[shape]()
    method = rng.choice(GRPC_METHODS)
    through_gateway = rng.random() < 0.5
    via = "gateway" if through_gateway else "direct"
    return Case("malformed_protobuf", f"{via}-{method}-{shape}", lambda t: grpc_call(t, method, data, through_gateway))


def json_as_grpc(rng: random.Random) -> Case:
    """A JSON body sent with gRPC's content type to a REST route (415), or to a gRPC path."""
    path = rng.choice(["/generate", "/generate_stream", "/v1/chat/completions", "/v1/messages", "/health"])
    content_type = rng.choice(["application/grpc", "application/grpc+proto", "application/grpc-web"])
    if rng.random() < 0.3:
        path = "/textgen.v1.TextGeneration/" + rng.choice(GRPC_METHODS)
    body = json.dumps(generate()).encode()
    return Case("json_as_grpc", f"{content_type}{path}", post(path, body, {"Content-Type": content_type}))


def oversized_headers(rng: random.Random) -> Case:
    """One header of 20-200 KB, or hundreds of headers (431 from the gateway past its limits)."""
    path = rng.choice(["/generate", "/generate_stream", "/health", "/v1/chat/completions"])
    body = chat() if path.startswith("/v1") else generate()
    if rng.random() < 0.5:
        size = rng.randint(20_000, 200_000)
        headers = {**JSON, "x-big": "a" * size}
        name = f"{path}-one-{size}"
    else:
        count = rng.randint(100, 400)
        headers = {**JSON, **{f"x-h{i}": str(i) for i in range(count)}}
        name = f"{path}-many-{count}"
    method = "GET" if path == "/health" else "POST"
    return Case("oversized_headers", name, lambda t: rest(t, path, None if method == "GET" else body, headers, method))


def huge_limits(rng: random.Random) -> Case:
    """Counts past every limit: tokens, stop lists, n, best_of, logprobs."""
    huge = rng.choice([2**31, 2**63 - 1, 2**64, 10**9, -1, 10**30])
    bodies = {
        "max_new_tokens": ("/generate", generate(max_new_tokens=huge)),
        "max_new_tokens_stream": ("/generate_stream", generate(max_new_tokens=huge)),
        "stop_list": ("/generate", generate(stop=["a"] * rng.randint(5, 5000))),
        "best_of": ("/generate", generate(best_of=huge, do_sample=True)),
        "top_n_tokens": ("/generate", generate(top_n_tokens=huge, details=True)),
        "truncate": ("/generate", generate(truncate=huge)),
        "max_tokens": ("/v1/chat/completions", chat(max_tokens=huge)),
        "n": ("/v1/chat/completions", chat(n=huge)),
        "top_logprobs": ("/v1/chat/completions", chat(logprobs=True, top_logprobs=huge)),
        "completion_logprobs": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": huge}),
        "chat_stop_list": ("/v1/chat/completions", chat(stop=["a"] * rng.randint(5, 5000))),
        "seed": ("/generate", generate(seed=huge, do_sample=True)),
        "messages_max_tokens": ("/v1/messages", message(max_tokens=huge)),
        "messages_stop_list": ("/v1/messages", message(stop_sequences=["a"] * rng.randint(5, 5000))),
        "long_input": ("/generate", {"inputs": "hello " * rng.randint(600, 20_000), "parameters": {}}),
    }
    if rng.random() < 0.25:  # the same over gRPC directly, as large as the field's type lets it be
        count = min(max(huge, 0), 2**32 - 1)
        fields = {
            "max_new_tokens": {"max_new_tokens": count},
            "best_of": {"best_of": count, "do_sample": True},
            "top_n_tokens": {"top_n_tokens": count, "details": True},
            "truncate": {"truncate": count},
            "stop": {"stop": ["a"] * rng.randint(5, 5000)},
        }
        name = rng.choice(sorted(fields))
        request = pb.GenerateRequest(inputs="Hello", parameters=pb.GenerateParameters(**fields[name]))
        method = rng.choice(["Generate", "GenerateStream"])
        return Case("huge_limits", f"grpc-{method}-{name}={count}", lambda t: grpc_call(t, method, request))
    name = rng.choice(sorted(bodies))
    path, body = bodies[name]
    return Case("huge_limits", f"{name}={huge}", post(path, body))


def deep_json(rng: random.Random) -> Case:
    """JSON nested thousands deep, where a value or the whole body goes."""
    depth = rng.choice([1000, 10_000, 100_000, 400_000])
    opening, closing = rng.choice([("[", "]"), ('{"a":', "}")])
    nested = opening * depth + "1" + closing * depth
    place = rng.choice(["inputs", "parameters", "extra", "body", "messages"])
    if place == "body":
        text, path = nested, "/generate"
    elif place == "messages":
        text, path = f'{{"messages":[{{"role":"user","content":{nested}}}],"max_tokens":2}}', "/v1/chat/completions"
    elif place == "extra":
        text, path = f'{{"inputs":"hi","parameters":{{"max_new_tokens":2}},"x":{nested}}}', "/generate"
    else:
        value = nested if place == "inputs" else f'{{"x":{nested}}}'
        text = '{"inputs":%s,"parameters":%s}' % (
            (value, '{"max_new_tokens":2}') if place == "inputs" else ('"hi"', value)
        )
        path = "/generate"
    return Case("deep_json", f"{place}-{opening}x{depth}", post(path, text.encode()))


def invalid_utf8(rng: random.Random) -> Case:
    """Bodies that are not UTF-8, lone surrogates, NULs, overlong forms."""
    pieces = {
        "bytes_ff": b"\xff\xfe\xfd",
        "overlong": b"\xc0\xaf",
        "truncated_sequence": b"\xe2\x82",
        "lone_surrogate_escape": b"\\ud800",
        "surrogate_bytes": b"\xed\xa0\x80",
        "nul": b"\x00",
    }
    name = rng.choice(sorted(pieces))
    piece = pieces[name] * rng.randint(1, 50)
    if rng.random() < 0.5:
        body, path = b'{"inputs":"hi ' + piece + b'","parameters":{"max_new_tokens":2}}', "/generate"
    else:
        body = b'{"messages":[{"role":"user","content":"' + piece + b'"}],"max_tokens":2}'
        path = "/v1/chat/completions"
    if rng.random() < 0.2:
        body = piece + body  # before the JSON starts
    return Case("invalid_utf8", f"{path}-{name}", post(path, body))


def wrong_shapes(rng: random.Random) -> Case:
    """Well-formed JSON of the wrong shape, methods and paths that do not exist."""
    bodies = {
        "inputs_number": ("/generate", {"inputs": 12345}),
        "inputs_list": ("/generate", {"inputs": ["a", "b"]}),
        "parameters_list": ("/generate", {"inputs": "hi", "parameters": [1, 2]}),
        "messages_empty": ("/v1/chat/completions", {"messages": []}),
        "messages_string": ("/v1/chat/completions", {"messages": "hi"}),
        "content_number": ("/v1/chat/completions", {"messages": [{"role": "user", "content": 1}]}),
        "tools_not_list": ("/v1/chat/completions", chat(tools={"a": 1})),
        "body_list": ("/generate", b"[1,2,3]"),
        "body_string": ("/v1/chat/completions", b'"hello"'),
        "empty_body": ("/generate", b""),
        "truncated_json": ("/generate", b'{"inputs":"hi","parameters":{'),
        "unknown_path": ("/" + "a" * rng.randint(10, 3000), generate()),
        "tokenize_bad": ("/tokenize", {"inputs": {"a": 1}}),
        "messages_no_max_tokens": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
        "messages_content_number": ("/v1/messages", message(messages=[{"role": "user", "content": 7}])),
    }
    name = rng.choice(sorted(bodies))
    path, body = bodies[name]
    method = rng.choice(["POST", "POST", "POST", "PUT", "DELETE", "PATCH"])
    return Case("wrong_shapes", f"{method}-{name}", lambda t: rest(t, path, body, JSON, method))


def broken_http(rng: random.Random) -> Case:
    """Bytes that are not (quite) HTTP/1.1: the gateway answers 4xx or closes, never reaching the engine."""
    requests = {
        "garbage": rng.randbytes(rng.randint(1, 4000)),
        "bad_request_line": b"GET\r\n\r\n",
        "http09": b"GET /health\r\n",
        "bad_chunked": b"POST /generate HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
        "short_body": b"POST /generate HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"inputs":',
        "both_lengths": b"POST /generate HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n"
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "h2_preface_garbage": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + rng.randbytes(rng.randint(1, 500)),
        "huge_url": b"GET /" + b"a" * rng.randint(70_000, 200_000) + b" HTTP/1.1\r\nHost: h\r\n\r\n",
    }
    name = rng.choice(sorted(requests))
    data = requests[name]
    return Case("broken_http", name, lambda t: raw_http(t, data))


SLOW_STARTS = [
    b"",  # connected, silent
    b"POST /generate HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\n",  # stuck in its headers
    b"POST /generate HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface, then nothing
]


def slow_connections(rng: random.Random) -> Case:
    """Connections to Envoy's port that start a request (or nothing) and stall for a while."""
    count, hold_s = rng.randint(5, 50), rng.uniform(0.2, 1.5)
    start = rng.choice(SLOW_STARTS)

    def send(target: Target) -> Answer:
        held = []
        try:
            for _ in range(count):
                sock = socket.create_connection(("127.0.0.1", target.gateway_port), timeout=TIMEOUT)
                held.append(sock)
                with contextlib.suppress(OSError):
                    sock.sendall(start)
            time.sleep(hold_s)
        finally:
            for sock in held:
                sock.close()
        return Answer(0, b"(closed by the caller)", "tcp")

    return Case("slow_connections", f"{count}x{start[:20]!r}", send)


LONG_STREAM = {"inputs": "a", "parameters": {"max_new_tokens": 200}}


def cancelled_stream(rng: random.Random) -> Case:
    """Streams whose caller goes away after a few events (the engine must free what they held)."""
    events = rng.randint(1, 10)
    route = rng.choice(["tgi", "chat", "grpc", "grpc-gateway"])
    if route == "tgi":
        return Case(
            "cancelled_stream",
            f"tgi-{events}",
            lambda t: cancelled_rest_stream(t, "/generate_stream", LONG_STREAM, events),
        )
    if route == "chat":
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
        return Case(
            "cancelled_stream",
            f"chat-{events}",
            lambda t: cancelled_rest_stream(t, "/v1/chat/completions", body, events),
        )
    request = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=200))
    through_gateway = route == "grpc-gateway"
    return Case(
        "cancelled_stream",
        f"{route}-{events}",
        lambda t: grpc_call(t, "GenerateStream", request, through_gateway, cancel_after=events),
    )


KINDS: dict[str, Callable[[random.Random], Case]] = {
    kind.__name__: kind
    for kind in (
        tiny_temperature,
        extreme_penalties,
        echoed_input,
        hostile_grammar,
        malformed_protobuf,
        json_as_grpc,
        oversized_headers,
        huge_limits,
        deep_json,
        invalid_utf8,
        wrong_shapes,
        broken_http,
        cancelled_stream,
        slow_connections,
    )
}


def case(spec: tuple[str, int]) -> Case:
    """The case of kind `spec[0]` made by seed `spec[1]` (the same on every run and process)."""
    kind, seed = spec
    return KINDS[kind](random.Random(f"{kind}-{seed}"))


def cases(kind: str, seeds: range) -> list[Case]:
    return [case((kind, seed)) for seed in seeds]


def mixed_specs(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """`count` (kind, seed) pairs over every kind, drawn by one seeded generator."""
    rng = random.Random(seed)
    names = sorted(KINDS)
    return [(rng.choice(names), rng.getrandbits(32)) for _ in range(count)]


def send_spec(spec: tuple[str, int], target: Target) -> tuple[str, str, str, int | str, list[str], float, float]:
    """Make and send one case, and judge its answer, in a worker process: the caller's process (where
    the innocent requests' clients run) neither unpickles nor parses answer bodies of up to megabytes,
    which held its GIL and so its clients. (Its name, its kind, its transport, its status, what was
    wrong with it, and when it was sent and answered: `time.monotonic()`, one clock for the machine's
    processes.)"""
    made = case(spec)
    started = time.monotonic()
    answer = made.send(target)
    ended = time.monotonic()
    return str(made), made.kind, answer.via, answer.status, problems(answer), started, ended


def grpc_stub(target: Target) -> generate_pb2_grpc.TextGenerationStub:
    return generate_pb2_grpc.TextGenerationStub(channel(target, through_gateway=False))
