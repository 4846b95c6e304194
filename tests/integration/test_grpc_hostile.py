"""Hostile calls over gRPC directly, each while an innocent stream runs on the same channel (one
HTTP/2 connection): the hostile call gets a typed status with a short message and small trailers,
and the stream's tokens are those it produces alone.

A message repeating a 100 KB input used to exceed gRPC's metadata limit (8 KiB by default), and
undecodable request bytes answered UNKNOWN, the code callers read as a server bug.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2

from inference_service.api.errors import MAX_MESSAGE_BYTES
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
BIG = "x" * 100_000
# The tiny model greedily generates from "a" to the length limit without an EOS: a long stream.
BYSTANDER = pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(max_new_tokens=300))
METADATA_LIMIT = 8 * 1024  # gRPC's default limit on a call's received metadata (headers, trailers)


def text(value: str) -> struct_pb2.Value:
    return struct_pb2.Value(string_value=value)


def chat(**fields) -> pb.ChatCompletionRequest:
    fields.setdefault("messages", [pb.ChatMessage(role="user", content=text("hi"))])
    return pb.ChatCompletionRequest(max_tokens=4, **fields)


def tool(name: str) -> pb.Tool:
    return pb.Tool(type="function", function=pb.FunctionDefinition(name=name))


def generate(**parameters) -> pb.GenerateRequest:
    return pb.GenerateRequest(inputs="hi", parameters=pb.GenerateParameters(max_new_tokens=2, **parameters))


HOSTILE = {
    "forced_bos_token": ("Generate", generate(forced_bos_token=BIG)),
    "regex": ("Generate", generate(grammar=pb.Grammar(type="regex", value=text("(" + BIG)))),
    "grammar_type": ("Generate", generate(grammar=pb.Grammar(type=BIG, value=text("a")))),
    "logit_bias_key": ("ChatCompletion", chat(logit_bias={BIG: 1.0})),
    "tool_name_twice": ("ChatCompletion", chat(tools=[tool(BIG), tool(BIG)])),
    "role": ("ChatCompletion", chat(messages=[pb.ChatMessage(role=BIG, content=text("hi"))])),
    "stream_role": ("ChatCompletionStream", chat(messages=[pb.ChatMessage(role=BIG, content=text("hi"))])),
}


@pytest.fixture(scope="module")
def alone(tiny_chat_grpc_server):
    tokens = [m.token.id for m in tiny_chat_grpc_server.stub.GenerateStream(BYSTANDER, timeout=TIMEOUT)]
    assert len(tokens) == 300
    return tokens


def start_bystander(server):
    stream = server.stub.GenerateStream(BYSTANDER, timeout=TIMEOUT)
    return stream, [next(stream).token.id]


def finish_bystander(server, stream, tokens: list[int], alone: list[int]) -> None:
    tokens += [m.token.id for m in stream]
    assert tokens == alone
    assert server.wait_idle().num_free_blocks == server.stats().num_total_blocks


def call(server, method: str, request):
    rpc = getattr(server.stub, method)
    result = rpc(request, timeout=TIMEOUT)
    return list(result) if method.endswith("Stream") else result


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_an_error_repeating_a_huge_input_is_short(tiny_chat_grpc_server, alone, kind):
    server = tiny_chat_grpc_server
    stream, tokens = start_bystander(server)
    method, request = HOSTILE[kind]
    with pytest.raises(grpc.RpcError) as raised:
        call(server, method, request)
    running = server.engine.stats().num_running
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details()[:300])
    trailers = error.trailing_metadata()
    assert dict(trailers)["x-error-type"] in ("validation", "template_error", "tool_error")
    assert len(error.details().encode()) <= MAX_MESSAGE_BYTES and "x" * 65 not in error.details()
    assert sum(len(key) + len(value) for key, value in trailers) < METADATA_LIMIT // 2
    assert running >= 1, "the bystander ended before the hostile call: nothing was checked"
    finish_bystander(server, stream, tokens, alone)


@pytest.mark.parametrize(
    ("method", "data"),
    [
        ("Generate", b"\x0a\xff\xff\xff\xff\x0f"),  # a length past the end of the message
        ("GenerateStream", b"\x0a\x05hi"),  # truncated
        ("ChatCompletion", b"\xff"),  # not a tag
        ("ChatCompletionStream", b"\x12\x03\xc3\x28a"),  # a string field that is not UTF-8
    ],
)
def test_undecodable_request_bytes_are_invalid_argument(tiny_chat_grpc_server, alone, method, data):
    server = tiny_chat_grpc_server
    stream, tokens = start_bystander(server)
    path = f"/textgen.v1.TextGeneration/{method}"
    invoke = (server.channel.unary_stream if method.endswith("Stream") else server.channel.unary_unary)(path)
    with pytest.raises(grpc.RpcError) as raised:
        result = invoke(data, timeout=TIMEOUT)
        if method.endswith("Stream"):
            list(result)
    error = raised.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert dict(error.trailing_metadata())["x-error-type"] == "validation"
    assert "protobuf message" in error.details() and "DecodeError" not in error.details()
    finish_bystander(server, stream, tokens, alone)


def test_a_decodable_request_still_reaches_its_handler(tiny_chat_grpc_server):
    """The decoding guard changes nothing for good bytes (the raw path as above, a real message)."""
    invoke = tiny_chat_grpc_server.channel.unary_unary("/textgen.v1.TextGeneration/Generate")
    reply = pb.GenerateResponse.FromString(invoke(generate(details=True).SerializeToString(), timeout=TIMEOUT))
    assert reply.details.generated_tokens == 2
