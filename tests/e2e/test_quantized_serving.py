"""Each `--quantize` scheme that runs here serves through gRPC and through Envoy's REST: sampling,
streaming, details, and `/info` naming the scheme and the weights' memory."""

from __future__ import annotations

import dataclasses
import json

import pytest

from textgen.v1 import generate_pb2 as pb

SCHEMES = ["eetq", "fp8", "bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_server_samples_streams_and_reports_itself(
    start_grpc_server, start_gateway, tiny_engine_config, scheme
):
    config = dataclasses.replace(
        tiny_engine_config, model=dataclasses.replace(tiny_engine_config.model, quantize=scheme)
    )
    server = start_grpc_server(config)
    parameters = pb.GenerateParameters(max_new_tokens=6, do_sample=True, seed=5, top_k=20, details=True)
    request = pb.GenerateRequest(inputs="the quick brown fox", parameters=parameters)
    unary = server.stub.Generate(request, timeout=60)
    streamed = list(server.stub.GenerateStream(request, timeout=60))
    assert unary.details.seed == 5 and len(unary.details.tokens) == unary.details.generated_tokens
    assert streamed[-1].generated_text == unary.generated_text  # seeded: the same tokens either way
    info = server.stub.Info(pb.InfoRequest(), timeout=10)
    assert info.quantize == scheme and info.weights_memory_bytes > 0

    gateway = start_gateway(server)
    body = json.loads(gateway.curl("/info"))
    assert body["quantize"] == scheme and isinstance(body["weights_memory_bytes"], int)
    generated = json.loads(
        gateway.curl(
            "/generate",
            body={
                "inputs": "the quick brown fox",
                "parameters": {"max_new_tokens": 6, "do_sample": True, "seed": 5, "top_k": 20, "details": True},
            },
        )
    )
    assert generated["generated_text"] == unary.generated_text
