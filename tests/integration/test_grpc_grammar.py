"""Grammars over the gRPC API: a JSON schema (as a Struct) and a regex constrain the output; an invalid
one is INVALID_ARGUMENT with the grammar engine's message; `--disable-grammar-support` refuses them."""

from __future__ import annotations

import dataclasses
import json
import re

import grpc
import jsonschema
import pytest
from google.protobuf import json_format

from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "open": {"type": "boolean"},
    },
    "required": ["city", "zip", "open"],
    "additionalProperties": False,
}


def grammar(kind: str, value) -> pb.Grammar:
    message = pb.Grammar(type=kind)
    json_format.ParseDict(value, message.value)
    return message


def request(value: pb.Grammar, max_new_tokens: int = 100) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        inputs="the quick brown fox",
        parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens, grammar=value, details=True),
    )


def test_json_schema_output_validates_unary_and_stream(tiny_grpc_server):
    response = tiny_grpc_server.stub.Generate(request(grammar("json", SCHEMA)), timeout=TIMEOUT)
    jsonschema.validate(json.loads(response.generated_text), SCHEMA)
    assert response.details.finish_reason == "eos_token"
    events = list(tiny_grpc_server.stub.GenerateStream(request(grammar("json", SCHEMA)), timeout=TIMEOUT))
    assert events[-1].generated_text == response.generated_text
    assert "".join(e.token.text for e in events) == response.generated_text
    # As JSON text the schema keeps its property order (a Struct is a map, which does not).
    text = tiny_grpc_server.stub.Generate(request(grammar("json", json.dumps(SCHEMA))), timeout=TIMEOUT)
    assert list(json.loads(text.generated_text)) == ["city", "zip", "open"]
    assert tiny_grpc_server.wait_idle().num_free_blocks == tiny_grpc_server.stats().num_total_blocks


def test_regex_output_full_matches(tiny_grpc_server):
    response = tiny_grpc_server.stub.Generate(request(grammar("regex", "[0-9]{3}-[a-z]{2,4}")), timeout=TIMEOUT)
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", response.generated_text), response.generated_text


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (grammar("json", {"type": "object", "properties": {"a": {"type": "nope"}}}), "Invalid type: nope"),
        (grammar("regex", "[0-9"), "unclosed character class"),
        (grammar("xml", "<a/>"), "unknown grammar type 'xml'"),
    ],
)
def test_invalid_grammar_is_invalid_argument(tiny_grpc_server, value, message):
    with pytest.raises(grpc.RpcError) as raised:
        tiny_grpc_server.stub.Generate(request(value), timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("Input validation error: grammar is not valid: ")
    assert message in raised.value.details()


def test_disabled_grammar_support_refuses_grammars(start_grpc_server, tiny_engine_config):
    config = dataclasses.replace(
        tiny_engine_config, limits=dataclasses.replace(tiny_engine_config.limits, disable_grammar_support=True)
    )
    server = start_grpc_server(config)
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Generate(request(grammar("regex", "[0-9]+")), timeout=TIMEOUT)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "Input validation error: grammar is not supported"
