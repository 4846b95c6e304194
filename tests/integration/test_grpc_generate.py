"""The gRPC API over a real loopback server on the tiny model: what it sends equals the engine's output."""

from __future__ import annotations

import math

import pytest

from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from tests.engine_calls import validated
from textgen.v1 import generate_pb2 as pb

TIMEOUT = 60
PROMPT = "the quick brown fox"


def engine_result(server, inputs: str, **parameters):
    """The engine's own answer to the same request, through its Python API."""
    engine = server.engine

    async def run():
        request = GenerateRequest(inputs=inputs, parameters=GenerateParameters(**parameters))
        return await engine.generate(await validated(engine, request, stream=False))

    return server.call(run())


def generate(server, **parameters) -> pb.GenerateResponse:
    request = pb.GenerateRequest(inputs=PROMPT, parameters=pb.GenerateParameters(**parameters))
    return server.stub.Generate(request, timeout=TIMEOUT)


def stream(server, **parameters) -> list[pb.StreamResponse]:
    request = pb.GenerateRequest(inputs=PROMPT, parameters=pb.GenerateParameters(**parameters))
    return list(server.stub.GenerateStream(request, timeout=TIMEOUT))


@pytest.mark.parametrize(
    "parameters",
    [
        {"max_new_tokens": 12},
        {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 3},
    ],
    ids=["greedy", "seeded-sampling"],
)
def test_unary_and_stream_equal_the_engine(tiny_grpc_server, parameters):
    expected = engine_result(tiny_grpc_server, PROMPT, **parameters)
    unary = generate(tiny_grpc_server, details=True, **parameters)
    messages = stream(tiny_grpc_server, details=True, **parameters)

    expected_ids = [t.id for t in expected.tokens]
    assert unary.generated_text == expected.generated_text
    assert [t.id for t in unary.details.tokens] == expected_ids
    assert [t.logprob for t in unary.details.tokens] == pytest.approx([t.logprob for t in expected.tokens])
    assert unary.details.finish_reason == expected.finish_reason.value
    assert unary.details.generated_tokens == expected.num_generated_tokens

    assert [m.token.id for m in messages] == expected_ids
    assert [m.index for m in messages] == list(range(1, len(messages) + 1))
    assert "".join(m.token.text for m in messages if not m.token.special) == expected.generated_text
    assert [m.HasField("generated_text") for m in messages] == [False] * (len(messages) - 1) + [True]
    final = messages[-1]
    assert final.generated_text == expected.generated_text
    assert final.details.finish_reason == expected.finish_reason.value
    assert final.details.input_length == expected.num_prompt_tokens


def test_seed_is_reported_only_when_sampling(tiny_grpc_server):
    greedy = generate(tiny_grpc_server, max_new_tokens=2, details=True)
    assert not greedy.details.HasField("seed")
    sampled = generate(tiny_grpc_server, max_new_tokens=2, details=True, do_sample=True, seed=1234)
    assert sampled.details.seed == 1234
    drawn = generate(tiny_grpc_server, max_new_tokens=2, details=True, do_sample=True)
    assert drawn.details.HasField("seed")


def test_details_only_when_asked(tiny_grpc_server):
    assert not generate(tiny_grpc_server, max_new_tokens=2).HasField("details")
    assert not any(m.HasField("details") for m in stream(tiny_grpc_server, max_new_tokens=2))


def test_prefill_top_tokens_and_full_text(tiny_grpc_server):
    response = generate(
        tiny_grpc_server, max_new_tokens=3, decoder_input_details=True, top_n_tokens=2, return_full_text=True
    )
    details = response.details
    assert response.generated_text.startswith(PROMPT)
    assert len(details.prefill) > 1 and math.isnan(details.prefill[0].logprob)
    assert all(not math.isnan(t.logprob) for t in details.prefill[1:])
    assert len(details.top_tokens) == len(details.tokens) == 3
    assert all(len(position.tokens) >= 2 for position in details.top_tokens)


def test_compat_generate_wraps_one_response_with_the_prompt(tiny_grpc_server):
    request = pb.GenerateRequest(inputs=PROMPT, stream=False, parameters=pb.GenerateParameters(max_new_tokens=3))
    response = tiny_grpc_server.stub.CompatGenerate(request, timeout=TIMEOUT)
    [only] = response.responses
    assert only.generated_text.startswith(PROMPT)
    expected = engine_result(tiny_grpc_server, PROMPT, max_new_tokens=3)
    assert only.generated_text == PROMPT + expected.generated_text


def test_best_of_returns_the_other_sequences(tiny_grpc_server):
    response = generate(tiny_grpc_server, max_new_tokens=3, best_of=2, do_sample=True, details=True)
    assert len(response.details.best_of_sequences) == 1
    assert response.details.best_of_sequences[0].HasField("seed")


def test_tokenize_info_models_metrics_health(tiny_grpc_server):
    stub = tiny_grpc_server.stub
    tokens = stub.Tokenize(pb.GenerateRequest(inputs=PROMPT), timeout=TIMEOUT).tokens
    expected = tiny_grpc_server.call(tiny_grpc_server.front_end.tokenize(PROMPT))
    assert [(t.id, t.text, t.start, t.stop) for t in tokens] == [(s.id, s.text, s.start, s.stop) for s in expected]

    info = stub.Info(pb.InfoRequest(), timeout=TIMEOUT)
    engine_info = tiny_grpc_server.engine.info
    assert info.model_id == engine_info.model_id and info.max_total_tokens == engine_info.max_total_tokens
    assert info.model_device_type == "cpu" and info.stats.num_total_blocks == engine_info.num_blocks

    models = stub.ListModels(pb.ListModelsRequest(), timeout=TIMEOUT)
    assert [m.id for m in models.data] == [engine_info.model_id]

    metrics = stub.Metrics(pb.MetricsRequest(), timeout=TIMEOUT)
    assert metrics.content_type.startswith("text/plain") and b"# HELP" in metrics.data

    assert stub.Health(pb.HealthRequest(), timeout=TIMEOUT).data == b""


def test_stop_sequence_ends_the_stream(tiny_grpc_server):
    free_run = engine_result(tiny_grpc_server, PROMPT, max_new_tokens=12)
    stop = free_run.generated_text[2:6]
    if len(stop.strip()) == 0:
        pytest.skip("the tiny model's text has no usable stop string here")
    messages = stream(tiny_grpc_server, max_new_tokens=12, stop=[stop], details=True)
    assert messages[-1].details.finish_reason == "stop_sequence"
    assert messages[-1].generated_text.endswith(stop)
