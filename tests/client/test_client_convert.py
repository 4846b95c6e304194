"""Pure conversions between the client's values and the protobuf messages (no server)."""

from __future__ import annotations

import math

import pytest
from google.protobuf import json_format

from textgen_client import (
    BestOfSequence,
    FinishReason,
    Grammar,
    PrefillToken,
    Token,
    ValidationError,
    _convert,
)
from textgen_client._proto.textgen.v1 import generate_pb2 as pb


def test_request_sets_only_given_parameters():
    request = _convert.build_request(
        "hi", {"max_new_tokens": 5, "top_p": None, "do_sample": False, "stop_sequences": ["\n", "."], "seed": 2**40}
    )
    params = request.parameters
    assert request.inputs == "hi"
    assert params.max_new_tokens == 5 and params.HasField("max_new_tokens")
    assert not params.HasField("top_p") and not params.HasField("temperature")
    assert params.HasField("do_sample") and params.do_sample is False  # sent: False is not absent
    assert list(params.stop) == ["\n", "."]
    assert params.seed == 2**40


def test_request_grammar_schema_is_sent_as_a_json_object():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = _convert.build_request("x", {"grammar": Grammar(type="json", value=schema)}).parameters
    assert params.grammar.type == "json"
    assert params.grammar.value.WhichOneof("kind") == "struct_value"
    assert json_format.MessageToDict(params.grammar.value) == schema
    params = _convert.build_request("x", {"grammar": {"type": "regex", "value": "[0-9]+"}}).parameters
    assert (params.grammar.type, params.grammar.value.string_value) == ("regex", "[0-9]+")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_new_tokens", -1),
        ("seed", -5),
        ("top_k", "3"),
        ("stop_sequences", "stop"),
        ("truncate", 2**40),
    ],
)
def test_request_values_protobuf_cant_hold_are_validation_errors(name, value):
    with pytest.raises(ValidationError) as caught:
        _convert.build_request("x", {name: value})
    assert caught.value.error_type == "validation" and caught.value.code is None
    assert name in caught.value.message


def test_request_prompt_must_be_text():
    with pytest.raises(ValidationError):
        _convert.build_request(b"bytes", {})  # type: ignore[arg-type]


def _details(**fields) -> pb.Details:
    return pb.Details(
        finish_reason="length",
        generated_tokens=2,
        prefill=[pb.PrefillToken(id=1, text="<s>", logprob=math.nan), pb.PrefillToken(id=7, text="a", logprob=-1.5)],
        tokens=[pb.Token(id=3, text=" b", logprob=-0.25), pb.Token(id=2, text="</s>", logprob=-2.0, special=True)],
        **fields,
    )


def test_response_with_details():
    response = _convert.response(pb.GenerateResponse(generated_text=" b</s>", details=_details()))
    details = response.details
    assert response.generated_text == " b</s>"
    assert details.finish_reason is FinishReason.LENGTH and details.finish_reason == "length"
    assert details.generated_tokens == 2
    assert details.seed is None  # greedy: absent on the wire
    assert details.prefill == [PrefillToken(1, "<s>", None), PrefillToken(7, "a", -1.5)]  # NaN -> None
    assert details.tokens == [Token(3, " b", -0.25, False), Token(2, "</s>", -2.0, True)]
    assert details.top_tokens is None and details.best_of_sequences is None


def test_response_seed_top_tokens_and_best_of():
    top = [pb.TopTokens(tokens=[pb.Token(id=3, text=" b", logprob=-0.25), pb.Token(id=4, text=" c", logprob=-3.0)])]
    loser = pb.BestOfSequence(
        generated_text="zz",
        finish_reason="eos_token",
        generated_tokens=1,
        seed=9,
        tokens=[pb.Token(id=5, text="zz", logprob=-4.0)],
    )
    message = pb.GenerateResponse(
        generated_text="b", details=_details(seed=0, top_tokens=top, best_of_sequences=[loser])
    )
    details = _convert.response(message).details
    assert details.seed == 0  # present though zero
    assert details.top_tokens == [[Token(3, " b", -0.25, False), Token(4, " c", -3.0, False)]]
    assert details.best_of_sequences == [
        BestOfSequence(
            generated_text="zz",
            finish_reason=FinishReason.EOS_TOKEN,
            generated_tokens=1,
            seed=9,
            prefill=[],
            tokens=[Token(5, "zz", -4.0, False)],
            top_tokens=None,
        )
    ]


def test_response_without_details_and_unknown_finish_reason():
    assert _convert.response(pb.GenerateResponse(generated_text="t")).details is None
    details = _convert.response(pb.GenerateResponse(details=pb.Details(finish_reason="new_reason"))).details
    assert details.finish_reason == "new_reason"  # kept as text, not an error


def test_stream_responses():
    token = pb.Token(id=3, text=" b", logprob=-0.5)
    middle = _convert.stream_response(pb.StreamResponse(index=1, token=token))
    assert middle.index == 1 and middle.token == Token(3, " b", -0.5, False)
    assert middle.generated_text is None and middle.details is None and middle.top_tokens is None
    last = _convert.stream_response(
        pb.StreamResponse(
            index=2,
            token=pb.Token(id=2, text="", logprob=-1.0, special=True),
            generated_text="",
            top_tokens=[pb.Token(id=2, text="", logprob=-1.0, special=True)],
            details=pb.StreamDetails(finish_reason="stop_sequence", generated_tokens=2, seed=4, input_length=6),
        )
    )
    assert last.generated_text == ""  # present though empty
    assert last.details.finish_reason is FinishReason.STOP_SEQUENCE
    assert (last.details.generated_tokens, last.details.seed, last.details.input_length) == (2, 4, 6)
    assert last.top_tokens == [Token(2, "", -1.0, True)]


def test_tokens_and_info():
    message = pb.TokenizeResponse(tokens=[pb.SimpleToken(id=5, text="ab", start=0, stop=2)])
    tokens = _convert.simple_tokens(message)
    assert [(t.id, t.text, t.start, t.stop) for t in tokens] == [(5, "ab", 0, 2)]
    stats = pb.EngineStats(num_total_blocks=8, num_free_blocks=8, num_steps=3)
    info = _convert.info(
        pb.InfoResponse(
            model_id="m",
            model_dtype="float32",
            max_total_tokens=512,
            max_batch_size=0,
            waiting_served_ratio=0.3,
            stats=stats,
        )
    )
    assert info.waiting_served_ratio == 0.3
    assert (info.model_id, info.model_dtype, info.max_total_tokens) == ("m", "float32", 512)
    assert info.model_sha is None and info.sha is None and info.docker_label is None
    assert info.max_batch_size == 0  # present though zero
    assert (info.stats.num_total_blocks, info.stats.num_free_blocks, info.stats.num_steps) == (8, 8, 3)
    assert _convert.info(pb.InfoResponse()).stats is None
