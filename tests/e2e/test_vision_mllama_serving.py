"""A served Mllama (cross-attention to the image, a tiny random one) through gRPC, Envoy's REST and
the OpenAI SDK: /info says transformers' attention serves it; an image as a data: URI answers what
the typed gRPC image bytes do; more images than --max-images-per-request are a 400 naming the limit."""

from __future__ import annotations

import json

import openai
import pytest

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from tests.e2e.test_vision_serving import image_message, start_grpc_server  # noqa: F401 — the module's fixture
from tests.image_server import data_uri, image_bytes
from tests.tiny_vision_mllama import save_mllama
from textgen.v1 import generate_pb2 as pb

RED, BLUE = (220, 20, 20), (20, 20, 220)


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_grpc_server, start_gateway):  # noqa: F811
    folder = save_mllama(tmp_path_factory.mktemp("tiny-mllama"))
    config = EngineConfig(
        model=ModelConfig(model_id=str(folder), device="cpu", dtype="float32"),
        cache=CacheConfig(max_batch_total_tokens=2048),
        limits=LimitsConfig(max_total_tokens=256, max_images_per_request=1),
    )
    server = start_grpc_server(config)
    return server, start_gateway(server)


def test_info_says_transformers_attention_and_images_are_answered(served):
    server, gateway = served
    info = json.loads(gateway.curl("/info"))
    assert info["attention_impl"] == "transformers"
    assert server.stub.Info(pb.InfoRequest(), timeout=10).attention_impl == "transformers"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    png = image_bytes(RED)
    by_uri = client.chat.completions.create(
        model="m", messages=image_message(data_uri(png)), max_tokens=6, temperature=0
    )
    typed = pb.ChatCompletionRequest(model="m", max_tokens=6, temperature=0)
    message = typed.messages.add(role="user")
    message.content.list_value.values.add().struct_value.update({"type": "text", "text": "what is in this image"})
    message.images.add(data=png)
    by_bytes = server.stub.ChatCompletion(typed, timeout=60)
    assert by_uri.choices[0].message.content == by_bytes.choices[0].message.content
    assert by_uri.usage.prompt_tokens == by_bytes.usage.prompt_tokens
    assert by_uri.usage.completion_tokens == 6


def test_more_images_than_allowed_are_a_400(served):
    _server, gateway = served
    parts = [{"type": "image_url", "image_url": {"url": data_uri(image_bytes(c))}} for c in (RED, BLUE)]
    raw = gateway.curl(
        "/v1/chat/completions",
        "-w",
        "\n%{http_code}",
        body={"messages": [{"role": "user", "content": parts}], "max_tokens": 2},
    )
    body, status = raw.rsplit("\n", 1)
    assert status == "400", body
    assert "at most 1 images" in json.loads(body)["error"]["message"]
