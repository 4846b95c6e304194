"""The gRPC API on the demo model (real weights), served with the default model id."""

from __future__ import annotations

import pytest

from inference_service.config import DEMO_MODEL_ID, ModelConfig
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from tests.engine_calls import validated
from textgen.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

TIMEOUT = 120
PROMPT = "What is deep learning?"


def test_default_model_is_the_demo(demo_grpc_server):
    assert ModelConfig().model_id == DEMO_MODEL_ID
    info = demo_grpc_server.stub.Info(pb.InfoRequest(), timeout=TIMEOUT)
    assert info.model_id == DEMO_MODEL_ID and info.model_device_type == "cpu"


def test_greedy_unary_and_stream_equal_the_engine(demo_grpc_server):
    engine = demo_grpc_server.engine

    async def run():
        request = GenerateRequest(inputs=PROMPT, parameters=GenerateParameters(max_new_tokens=16))
        return await engine.generate(await validated(engine, request, stream=False))

    expected = demo_grpc_server.call(run())
    request = pb.GenerateRequest(inputs=PROMPT, parameters=pb.GenerateParameters(max_new_tokens=16, details=True))
    unary = demo_grpc_server.stub.Generate(request, timeout=TIMEOUT)
    messages = list(demo_grpc_server.stub.GenerateStream(request, timeout=TIMEOUT))

    assert expected.generated_text.strip()  # a real model says something
    assert unary.generated_text == messages[-1].generated_text == expected.generated_text
    assert [t.id for t in unary.details.tokens] == [m.token.id for m in messages] == [t.id for t in expected.tokens]
    assert "".join(m.token.text for m in messages if not m.token.special) == expected.generated_text
