"""OpenAI's RPCs over gRPC with the generated stubs: typed messages, status codes for errors, and no
REST-only markers (done, heartbeats) unless the gateway's headers ask for them."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2

from tests.tool_schemas import TIME_ZONE_PARAMETERS
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
    chunks = list(
        stub.ChatCompletionStream(
            chat(temperature=0, max_tokens=8, stream_options=pb.StreamOptions(include_usage=True)), timeout=60
        )
    )
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
    cases = [
        (chat(temperature=-1), "validation"),
        (pb.ChatCompletionRequest(messages=[pb.ChatMessage(role="wizard", content=text("x"))]), "template_error"),
        (
            chat(
                tools=[pb.Tool(type="function", function=pb.FunctionDefinition(name="f"))],
                tool_choice=struct_pb2.Value(string_value="maybe"),
            ),
            "tool_error",
        ),
    ]
    for request, kind in cases:
        with pytest.raises(grpc.RpcError) as failed:
            result = call(request, timeout=60)
            list(result) if method.endswith("Stream") else result
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and error_type(failed.value) == kind


def test_a_model_without_template_is_told_how_to_fix_it(tiny_grpc_server):
    with pytest.raises(grpc.RpcError) as failed:
        tiny_grpc_server.stub.ChatCompletion(chat(), timeout=60)
    assert error_type(failed.value) == "template_error" and "--chat-template" in failed.value.details()


def test_seeded_choices_logprobs_and_metrics(tiny_chat_grpc_server):
    stub = tiny_chat_grpc_server.stub

    def counter(name: str) -> float:
        text = stub.Metrics(pb.MetricsRequest(), timeout=10).data.decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))

    before = counter("tgi_request_success")
    request = chat(temperature=1.0, seed=7, n=3, max_tokens=6, logprobs=True, top_logprobs=3)
    first, again = stub.ChatCompletion(request, timeout=60), stub.ChatCompletion(request, timeout=60)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1
    for choice in first.choices:
        entries = choice.logprobs.content
        assert entries and all(len(e.top_logprobs) == 3 and e.logprob <= 0 for e in entries)
        assert all(e.top_logprobs[0].logprob >= e.logprob for e in entries)  # the best alternative comes first
    assert counter("tgi_request_success") == before + 2  # a call counts once, whatever its choices


def test_json_schema_and_tools_over_grpc(tiny_chat_grpc_server):
    import json

    import jsonschema
    from google.protobuf import json_format

    stub = tiny_chat_grpc_server.stub
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    response_format = pb.ResponseFormat(
        type="json_schema",
        json_schema=pb.JsonSchemaFormat(name="answer", schema=json_format.ParseDict(schema, struct_pb2.Struct())),
    )
    reply = stub.ChatCompletion(chat(temperature=0, max_tokens=20, response_format=response_format), timeout=60)
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)

    parameters = TIME_ZONE_PARAMETERS
    tool = pb.Tool(
        type="function",
        function=pb.FunctionDefinition(
            name="get_time", parameters=json_format.ParseDict(parameters, struct_pb2.Struct())
        ),
    )
    named = struct_pb2.Value(
        struct_value=json_format.ParseDict({"type": "function", "function": {"name": "get_time"}}, struct_pb2.Struct())
    )
    reply = stub.ChatCompletion(
        chat(temperature=0, max_tokens=80, tools=[tool], tool_choice=named, tool_prompt="Tools:"), timeout=60
    )
    (choice,) = reply.choices
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_chat_logprobs_leave_out_only_a_final_eos(tiny_chat_grpc_server):
    tokenizer = tiny_chat_grpc_server.front_end.tokenizer
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")  # special, but not an end of text
    stub = tiny_chat_grpc_server.stub
    request = chat(temperature=0, max_tokens=3, logprobs=True, logit_bias={str(special): 100.0})
    (choice,) = stub.ChatCompletion(request, timeout=60).choices
    assert choice.finish_reason == "length" and choice.message.content == ""  # special tokens are never text
    assert [e.token for e in choice.logprobs.content] == ["<|im_start|>"] * 3  # but they are logprob entries
    streamed = [e.token for c in stub.ChatCompletionStream(request, timeout=60) for e in c.choices[0].logprobs.content]
    assert streamed == ["<|im_start|>"] * 3

    ended = chat(temperature=0, max_tokens=3, logprobs=True, logit_bias={str(tokenizer.eos_token_id): 100.0})
    (choice,) = stub.ChatCompletion(ended, timeout=60).choices
    assert choice.finish_reason == "stop" and list(choice.logprobs.content) == []  # the final EOS is left out
    assert all(not c.choices[0].logprobs.content for c in stub.ChatCompletionStream(ended, timeout=60))


def test_chat_logprobs_of_part_of_a_character_show_its_bytes(tiny_chat_grpc_server):
    tokenizer = tiny_chat_grpc_server.front_end.tokenizer
    first_byte = "日".encode()[0]  # 0xe6: GPT-2's byte alphabet writes it as "æ"
    token_id = tokenizer.convert_tokens_to_ids(chr(first_byte))
    request = chat(temperature=0, max_tokens=2, logprobs=True, top_logprobs=2, logit_bias={str(token_id): 100.0})
    (choice,) = tiny_chat_grpc_server.stub.ChatCompletion(request, timeout=60).choices
    assert len(choice.logprobs.content) == 2
    for entry in choice.logprobs.content:
        assert entry.token == "\\xe6" and list(entry.bytes) == [first_byte]
    alternatives = [top for entry in choice.logprobs.content for top in entry.top_logprobs]  # raw: before the bias
    for top in alternatives:
        raw = bytes(top.bytes)
        try:
            assert top.token == raw.decode()
        except UnicodeDecodeError:
            assert top.token == "".join(f"\\x{byte:02x}" for byte in raw)
