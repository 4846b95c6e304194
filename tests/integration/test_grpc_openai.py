"""OpenAI's RPCs over gRPC with the generated stubs: typed messages, status codes for errors, and no
REST-only markers (done, heartbeats) unless the gateway's headers ask for them."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2

from textgen.v1 import generate_pb2 as pb


def text(value: str) -> struct_pb2.Value:
    return struct_pb2.Value(string_value=value)


def user(content: str) -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content=text(content))


def chat(**fields) -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(messages=[user("the quick brown fox")], **fields)


def error_type(error: grpc.RpcError) -> str:
    return dict(error.trailing_metadata())["x-error-type"]


def test_chat_completion_unary_and_stream(tiny_chat_grpc_server):
    stub = tiny_chat_grpc_server.stub
    response = stub.ChatCompletion(chat(temperature=0, max_tokens=8, n=2), timeout=60)
    assert response.object == "chat.completion" and len(response.choices) == 2
    assert response.choices[0].message.content == response.choices[1].message.content  # greedy: equal choices
    assert response.usage.completion_tokens > 0 and response.usage.completion_tokens % 2 == 0  # two equal choices
    chunks = list(stub.ChatCompletionStream(chat(temperature=0, max_tokens=8,
                                                 stream_options=pb.StreamOptions(include_usage=True)), timeout=60))
    assert not any(c.done or c.keep_alive or c.HasField("error") for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == response.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens // 2


def test_completion_and_models(tiny_chat_grpc_server):
    stub = tiny_chat_grpc_server.stub
    prompts = struct_pb2.Value(list_value=struct_pb2.ListValue(values=[text("a b"), text("c d")]))
    response = stub.Completion(pb.CompletionRequest(prompt=prompts, max_tokens=4, temperature=0), timeout=60)
    assert [c.index for c in response.choices] == [0, 1] and response.object == "text_completion"
    model_id = stub.ListModels(pb.ListModelsRequest(), timeout=10).data[0].id
    assert stub.GetModel(pb.GetModelRequest(id=model_id), timeout=10).id == model_id
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetModel(pb.GetModelRequest(id="other"), timeout=10)
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND and error_type(missing.value) == "not_found"


@pytest.mark.parametrize("method", ["ChatCompletion", "ChatCompletionStream"])
def test_errors_are_statuses(tiny_chat_grpc_server, method):
    call = getattr(tiny_chat_grpc_server.stub, method)
    cases = [(chat(temperature=-1), "validation"),
             (pb.ChatCompletionRequest(messages=[pb.ChatMessage(role="wizard", content=text("x"))]), "template_error"),
             (chat(tools=[pb.Tool(type="function", function=pb.FunctionDefinition(name="f"))],
                   tool_choice=struct_pb2.Value(string_value="maybe")), "tool_error")]
    for request, kind in cases:
        with pytest.raises(grpc.RpcError) as failed:
            result = call(request, timeout=60)
            list(result) if method.endswith("Stream") else result
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_type(failed.value) == kind


def test_a_model_without_template_is_told_how_to_fix_it(tiny_grpc_server):
    with pytest.raises(grpc.RpcError) as failed:
        tiny_grpc_server.stub.ChatCompletion(chat(), timeout=60)
    assert error_type(failed.value) == "template_error" and "--chat-template" in failed.value.details()
