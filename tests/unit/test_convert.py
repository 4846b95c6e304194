"""pb ⇄ domain conversions of the public API."""

from __future__ import annotations

import dataclasses
import math

import pytest
from google.protobuf import json_format, struct_pb2

from inference_service.api import convert
from inference_service.config import SchedulerConfig
from inference_service.frontend import tgi
from inference_service.frontend.parameters import GenerateParameters
from inference_service.outputs import (
    EngineInfo,
    EngineStats,
    FinishReason,
    GenerateResult,
    PrefillToken,
    RequestOutput,
    Token,
)
from textgen.v1 import generate_pb2 as pb


def tok(i: int, logprob: float = -0.5, special: bool = False) -> Token:
    return Token(id=i, text=f"t{i}", logprob=logprob, special=special)


# -- requests -----------------------------------------------------------------------------------
def test_every_proto_parameter_is_a_domain_parameter():
    proto_fields = {f.name for f in pb.GenerateParameters.DESCRIPTOR.fields}
    openai_only = {"presence_penalty", "logit_bias"}  # set by the OpenAI routes, not TGI's
    assert proto_fields == {f.name for f in dataclasses.fields(GenerateParameters)} - openai_only


def test_absent_optionals_are_none_and_zeros_stay_zeros():
    request = pb.GenerateRequest(
        inputs="hi",
        parameters=pb.GenerateParameters(temperature=0.0, top_k=0, max_new_tokens=0, seed=0, do_sample=False),
    )
    params = tgi.request_from_pb(request).parameters
    assert (params.temperature, params.top_k, params.max_new_tokens, params.seed) == (0.0, 0, 0, 0)
    assert params.top_p is None and params.best_of is None and params.truncate is None
    assert params.return_full_text is None and params.top_n_tokens is None and params.grammar is None


def test_values_are_carried_over():
    request = pb.GenerateRequest(
        inputs="héllo",
        parameters=pb.GenerateParameters(
            best_of=2,
            temperature=0.5,
            repetition_penalty=1.2,
            frequency_penalty=-0.5,
            top_k=7,
            top_p=0.75,
            typical_p=0.5,
            do_sample=True,
            max_new_tokens=12,
            return_full_text=True,
            stop=["a", "\n"],
            truncate=9,
            watermark=True,
            details=True,
            decoder_input_details=True,
            seed=2**64 - 1,
            top_n_tokens=3,
            adapter_id="x",
            grammar=pb.Grammar(type="regex", value=struct_pb2.Value(string_value="[a-z]+")),
        ),
    )
    domain = tgi.request_from_pb(request)
    assert domain.inputs == "héllo"
    assert domain.parameters == GenerateParameters(
        best_of=2,
        temperature=0.5,
        repetition_penalty=pytest.approx(1.2),
        frequency_penalty=-0.5,
        top_k=7,
        top_p=0.75,
        typical_p=0.5,
        do_sample=True,
        max_new_tokens=12,
        return_full_text=True,
        stop=["a", "\n"],
        truncate=9,
        watermark=True,
        details=True,
        decoder_input_details=True,
        seed=2**64 - 1,
        top_n_tokens=3,
        adapter_id="x",
        grammar={"type": "regex", "value": "[a-z]+"},
    )


def test_whole_numbers_of_a_grammar_schema_come_back_as_ints():
    schema = {"type": "string", "maxLength": 8, "minimum": 0.5, "enum": [1, 2.5, True, None, "3"]}
    grammar = pb.Grammar(type="json")
    json_format.ParseDict(schema, grammar.value)  # a Value: every number is a double
    value = tgi.parameters_from_pb(pb.GenerateParameters(grammar=grammar)).grammar["value"]
    assert value == schema and type(value["maxLength"]) is int and type(value["enum"][0]) is int
    assert value["enum"][2] is True


def test_a_grammar_schema_object_reaches_validation_as_a_dict():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = pb.Grammar(type="json")
    json_format.ParseDict(schema, grammar.value)
    request = pb.GenerateRequest(inputs="x", parameters=pb.GenerateParameters(grammar=grammar))
    assert tgi.request_from_pb(request).parameters.grammar == {"type": "json", "value": schema}


def test_absent_parameters_are_all_defaults():
    assert tgi.request_from_pb(pb.GenerateRequest(inputs="hi")).parameters == GenerateParameters()


@pytest.mark.parametrize(
    ("request_pb", "compat", "expected"),
    [
        (pb.GenerateRequest(inputs="a"), False, None),
        (pb.GenerateRequest(inputs="a"), True, True),
        (pb.GenerateRequest(inputs="a", stream=False), False, True),  # the root route's body
        (pb.GenerateRequest(inputs="a", stream=True, parameters=pb.GenerateParameters()), False, True),
        (pb.GenerateRequest(inputs="a", parameters=pb.GenerateParameters(return_full_text=False)), True, False),
    ],
)
def test_root_route_returns_full_text_by_default(request_pb, compat, expected):
    assert tgi.request_from_pb(request_pb, compat_route=compat).parameters.return_full_text is expected


def test_details_are_wanted_when_asked():
    assert not tgi.wants_details(pb.GenerateRequest(inputs="a"))
    assert tgi.wants_details(pb.GenerateRequest(parameters=pb.GenerateParameters(details=True)))
    prefill_only = pb.GenerateParameters(decoder_input_details=True)
    assert tgi.wants_details(pb.GenerateRequest(parameters=prefill_only))


# -- streams ------------------------------------------------------------------------------------
def test_one_message_per_token_with_running_index():
    output = RequestOutput("r", tokens=[tok(5), tok(6), tok(7)])
    responses = convert.stream_responses_to_pb(output, first_index=4, details=True)
    assert [r.index for r in responses] == [4, 5, 6]
    assert [r.token.id for r in responses] == [5, 6, 7]
    assert not any(r.HasField("generated_text") or r.HasField("details") for r in responses)


def test_final_output_puts_text_and_details_on_its_last_token():
    output = RequestOutput(
        "r",
        tokens=[tok(1), tok(2, special=True)],
        finish_reason=FinishReason.EOS_TOKEN,
        generated_text="t1",
        num_generated_tokens=5,
        num_prompt_tokens=3,
        seed=42,
    )
    first, last = convert.stream_responses_to_pb(output, first_index=4, details=True)
    assert not first.HasField("generated_text")
    assert last.generated_text == "t1" and last.token.special
    assert last.details == pb.StreamDetails(finish_reason="eos_token", generated_tokens=5, seed=42, input_length=3)


def test_stream_details_only_when_asked_and_seed_absent_for_greedy():
    output = RequestOutput(
        "r",
        tokens=[tok(1)],
        finish_reason=FinishReason.LENGTH,
        generated_text="",
        num_generated_tokens=1,
        num_prompt_tokens=2,
        seed=None,
    )
    [without] = convert.stream_responses_to_pb(output, first_index=1, details=False)
    assert without.HasField("generated_text") and not without.HasField("details")
    [with_details] = convert.stream_responses_to_pb(output, first_index=1, details=True)
    assert not with_details.details.HasField("seed")


def test_final_output_without_a_token_still_ends_the_stream():
    output = RequestOutput("r", finish_reason=FinishReason.STOP_SEQUENCE, generated_text="abc", num_generated_tokens=3)
    [response] = convert.stream_responses_to_pb(output, first_index=4, details=False)
    assert response.generated_text == "abc" and not response.HasField("token")


def test_stream_top_tokens_follow_their_token():
    output = RequestOutput("r", tokens=[tok(1), tok(2)], top_tokens=[[tok(1), tok(9)], [tok(2)]])
    first, second = convert.stream_responses_to_pb(output, first_index=1, details=False)
    assert [t.id for t in first.top_tokens] == [1, 9] and [t.id for t in second.top_tokens] == [2]


# -- whole responses ----------------------------------------------------------------------------
def result(**overrides) -> GenerateResult:
    fields = dict(
        generated_text="out",
        finish_reason=FinishReason.LENGTH,
        num_generated_tokens=2,
        num_prompt_tokens=2,
        seed=None,
        tokens=[tok(1), tok(2)],
        top_tokens=[[], []],
        prefill_tokens=[],
    )
    return GenerateResult(**{**fields, **overrides})


def test_details_are_left_out_unless_asked():
    response = convert.generate_response_to_pb(result(), details=False)
    assert response.generated_text == "out" and not response.HasField("details")


def test_details_of_a_greedy_result():
    details = convert.generate_response_to_pb(result(), details=True).details
    assert details.finish_reason == "length" and details.generated_tokens == 2
    assert not details.HasField("seed")
    assert [t.id for t in details.tokens] == [1, 2] and details.tokens[0].logprob == -0.5
    assert len(details.top_tokens) == 0 and len(details.prefill) == 0 and len(details.best_of_sequences) == 0


def test_first_prefill_logprob_is_nan():
    prefill = [PrefillToken(1, "a", None), PrefillToken(2, "b", -1.25)]
    details = convert.generate_response_to_pb(result(prefill_tokens=prefill), details=True).details
    assert math.isnan(details.prefill[0].logprob) and details.prefill[1].logprob == -1.25


def test_top_tokens_one_list_per_token():
    top_tokens = [[tok(1), tok(3)], [tok(2)]]
    details = convert.generate_response_to_pb(result(top_tokens=top_tokens), details=True).details
    assert [[t.id for t in position.tokens] for position in details.top_tokens] == [[1, 3], [2]]


def test_best_of_sequences_carry_their_seed():
    loser = result(generated_text="lost", seed=7, finish_reason=FinishReason.EOS_TOKEN)
    details = convert.generate_response_to_pb(result(seed=8, best_of_sequences=[loser]), details=True).details
    assert details.seed == 8
    [sequence] = details.best_of_sequences
    assert (sequence.generated_text, sequence.finish_reason, sequence.seed) == ("lost", "eos_token", 7)


# -- the rest -----------------------------------------------------------------------------------
INFO = EngineInfo(
    model_id="m",
    model_sha=None,
    architecture="LlamaForCausalLM",
    dtype="float32",
    device="cuda:0",
    vocab_size=10,
    eos_token_ids=(2,),
    block_size=16,
    num_blocks=8,
    max_input_tokens=99,
    max_total_tokens=100,
    max_batch_prefill_tokens=512,
    max_batch_size=None,
    max_concurrent_requests=3,
    max_best_of=2,
    max_stop_sequences=4,
    max_top_n_tokens=5,
)


def test_info_has_tgi_fields_and_stats():
    stats = EngineStats(
        num_waiting=1, num_running=2, num_free_blocks=5, num_total_blocks=8, num_preemptions=0, num_steps=11
    )
    info = convert.info_to_pb(INFO, SchedulerConfig(), stats)
    assert (info.model_id, info.model_device_type, info.max_input_tokens, info.max_total_tokens) == (
        "m",
        "cuda",
        99,
        100,
    )
    assert info.max_batch_total_tokens == 128 and info.block_size == 16 and info.max_concurrent_requests == 3
    assert not info.HasField("model_sha") and not info.HasField("max_batch_size")
    assert info.waiting_served_ratio == pytest.approx(0.3) and info.max_waiting_tokens == 20
    assert info.stats.num_free_blocks == 5 and info.stats.num_steps == 11


def test_model_list_is_openai_shaped():
    models = convert.models_to_pb(dataclasses.replace(INFO, loaded_at=1_700_000_000))
    assert models.object == "list"
    assert models.data[0] == pb.ModelCard(id="m", object="model", created=1_700_000_000, owned_by="m")


def test_tokenize_spans():
    from inference_service.frontend.parameters import TokenSpan

    response = convert.tokenize_response_to_pb([TokenSpan(1, "", 0, 0), TokenSpan(5, "hé", 0, 2)])
    assert [(t.id, t.text, t.start, t.stop) for t in response.tokens] == [(1, "", 0, 0), (5, "hé", 0, 2)]


def test_plain_json_gives_whole_numbers_and_one_key_order():
    from inference_service.frontend.plain_json import plain_json

    first = plain_json({"b": 8.0, "a": [{"y": 1.5, "x": 2.0}]})
    assert first == {"a": [{"x": 2, "y": 1.5}], "b": 8} and list(first) == ["a", "b"]
    assert list(plain_json({"a": 1, "b": 2})) == list(plain_json({"b": 2, "a": 1}))
