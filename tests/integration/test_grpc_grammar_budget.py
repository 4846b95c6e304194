"""Hostile grammars over gRPC: each is refused at validation (INVALID_ARGUMENT, "grammar is too complex"
or "not valid") or accepted and completing, and a bystander request completes while one compiles.
Compiles run on the compiler's own threads, outside the engine loop."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import re
import time

import grpc
import pytest
from google.protobuf import json_format, struct_pb2

from tests.unit.test_grammar import chained_schema
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60


def grammar(kind: str, value) -> pb.Grammar:
    message = pb.Grammar(type=kind)
    json_format.ParseDict(value, message.value)
    return message


def generate(value: pb.Grammar | None, max_new_tokens: int) -> pb.GenerateRequest:
    parameters = pb.GenerateParameters(max_new_tokens=max_new_tokens)
    if value is not None:
        parameters.grammar.CopyFrom(value)
    return pb.GenerateRequest(inputs="the quick brown fox", parameters=parameters)


def chat_with_regex(regex: str) -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(
        messages=[pb.ChatMessage(role="user", content=struct_pb2.Value(string_value="hi"))],
        max_tokens=8,
        response_format=pb.ResponseFormat(type="regex", value=struct_pb2.Value(string_value=regex)),
    )


def invalid_argument(call) -> str:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    return raised.value.details()


def test_a_deep_schema_and_nested_quantifiers_are_accepted_and_complete(tiny_grpc_server):
    forced = '{"x": ' + "[" * 62  # the chained schema allows nothing else at first
    text = tiny_grpc_server.stub.Generate(
        generate(grammar("json", chained_schema()), 12), timeout=TIMEOUT
    ).generated_text
    assert text and forced.startswith(text[: len(forced)])
    text = tiny_grpc_server.stub.Generate(generate(grammar("regex", "((a+)+)+b"), 12), timeout=TIMEOUT).generated_text
    assert re.fullmatch("a+b?", text), text
    assert tiny_grpc_server.wait_idle().num_free_blocks == tiny_grpc_server.stats().num_total_blocks


def test_a_huge_counted_repetition_is_refused_at_validation(tiny_grpc_server):
    details = invalid_argument(
        lambda: tiny_grpc_server.stub.Generate(generate(grammar("regex", "a{1000000}"), 4), timeout=TIMEOUT)
    )
    assert details.startswith("Input validation error: grammar is too complex: "), details


@pytest.mark.parametrize(
    ("regex", "message"),
    [
        (r"[^\s\S]", "grammar is not valid: no text matches it"),  # was a 200 with empty content
        ("(" + "x" * 20_000, "unclosed group"),  # echoed input shortened: a small trailer
        ("a{1000000}", "grammar is too complex: "),  # a 422, not a failure mid-generation
    ],
)
def test_a_chat_response_format_regex_that_cannot_be_built_is_refused(tiny_chat_grpc_server, regex, message):
    details = invalid_argument(
        lambda: tiny_chat_grpc_server.stub.ChatCompletion(chat_with_regex(regex), timeout=TIMEOUT)
    )
    assert message in details and len(details) < 400, details


def test_a_bystander_completes_while_a_hostile_grammar_compiles(start_grpc_server, tiny_engine_config):
    # A budget long enough that the hostile grammar runs its whole (seconds-long) course.
    limits = dataclasses.replace(tiny_engine_config.limits, grammar_compile_timeout_ms=120_000)
    server = start_grpc_server(dataclasses.replace(tiny_engine_config, limits=limits))
    compiler = server.engine.grammar_compiler
    hostile = generate(grammar("regex", "((a{100}){100}){100}"), 4)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(lambda: invalid_argument(lambda: server.stub.Generate(hostile, timeout=TIMEOUT)))
        while compiler.num_running == 0 and not refused.done():
            time.sleep(0.005)
        bystander = server.stub.Generate(generate(None, 1), timeout=TIMEOUT)
        assert compiler.num_running == 1 and not refused.done()  # it finished while the grammar compiled
        assert bystander.generated_text
        assert "grammar is too complex: " in refused.result(timeout=TIMEOUT)
    assert server.wait_idle().num_free_blocks == server.stats().num_total_blocks


def test_grammar_flags_reach_the_compiler(start_grpc_server, tiny_engine_config):
    limits = dataclasses.replace(tiny_engine_config.limits, grammar_compile_timeout_ms=1234, grammar_max_states=777)
    server = start_grpc_server(dataclasses.replace(tiny_engine_config, limits=limits))
    budget = server.engine.grammar_compiler.budget
    assert (budget.compile_timeout_s, budget.max_lexer_states) == (1.234, 777)
    schema = json.dumps({"type": "string"})
    assert server.stub.Generate(generate(grammar("json", schema), 4), timeout=TIMEOUT).generated_text.startswith('"')
