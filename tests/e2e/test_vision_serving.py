"""A served vision-language model (a tiny random LLaVA) through gRPC, Envoy's REST and the OpenAI
SDK: images as data: URIs, as URLs a local HTTP server serves, as bytes in the typed request and as
TGI's Markdown in `inputs`; usage counts the image tokens; every bad input is a 400 naming it (OpenAI's
invalid_request_error, as every validation error on the OpenAI routes)."""

from __future__ import annotations

import io
import json
import random

import openai
import pytest

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from tests.image_server import data_uri, image_bytes, serving
from tests.tiny_vision import save_llava
from textgen.v1 import generate_pb2 as pb

RED = (220, 20, 20)
NUM_IMAGE_TOKENS = 16  # the tiny LLaVA's 32x32 images in 8x8 patches
MAX_FETCH = 20_000


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_grpc_server, start_gateway):
    folder = save_llava(tmp_path_factory.mktemp("tiny-llava"))
    config = EngineConfig(
        model=ModelConfig(model_id=str(folder), device="cpu", dtype="float32"),
        cache=CacheConfig(max_batch_total_tokens=2048),
        limits=LimitsConfig(max_total_tokens=256, max_images_per_request=2, max_image_fetch_size=MAX_FETCH),
    )
    server = start_grpc_server(config)
    return server, start_gateway(server)


@pytest.fixture(scope="module")
def start_grpc_server():
    """Module-scoped here: one served model for every test of the module."""
    from tests.conftest import GrpcServerThread

    servers = []

    def start(engine_config):
        servers.append(GrpcServerThread(engine_config))
        return servers[-1]

    yield start
    for server in servers:
        server.stop(timeout_s=1.0)


def image_message(url: str, text: str = "what is in this image") -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


def noise_png(size: int) -> bytes:
    """A PNG that does not compress: larger than MAX_FETCH at 100x100."""
    from PIL import Image

    rng = random.Random(0)
    image = Image.frombytes("RGB", (size, size), bytes(rng.randrange(256) for _ in range(size * size * 3)))
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def test_openai_sdk_with_a_data_uri_and_a_url_of_the_same_image(served):
    server, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    png = image_bytes(RED)
    by_uri = client.chat.completions.create(
        model="m", messages=image_message(data_uri(png)), max_tokens=8, temperature=0
    )
    with serving({"/red.png": png}) as base:
        by_url = client.chat.completions.create(
            model="m", messages=image_message(f"{base}/red.png"), max_tokens=8, temperature=0
        )
    assert by_uri.choices[0].message.content == by_url.choices[0].message.content
    assert by_uri.usage.completion_tokens == 8
    info = server.stub.Info(pb.InfoRequest(), timeout=10)
    assert info.attention_impl == "paged"
    text_only = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "what is in this image"}], max_tokens=1, temperature=0
    )
    # The image's one placeholder became its 16 tokens; the newline after it in the template is extra.
    assert by_uri.usage.prompt_tokens > text_only.usage.prompt_tokens + NUM_IMAGE_TOKENS - 1


def test_grpc_typed_image_bytes_answer_as_the_data_uri_does(served):
    server, gateway = served
    png = image_bytes(RED)
    typed = pb.ChatCompletionRequest(model="m", max_tokens=8, temperature=0)
    message = typed.messages.add(role="user")
    message.content.list_value.values.add().struct_value.update({"type": "text", "text": "what is in this image"})
    message.images.add(data=png)
    answer = server.stub.ChatCompletion(typed, timeout=60)
    rest = json.loads(
        gateway.curl(
            "/v1/chat/completions",
            body={"messages": image_message(data_uri(png)), "max_tokens": 8, "temperature": 0},
        )
    )
    assert answer.choices[0].message.content == rest["choices"][0]["message"]["content"]
    assert answer.usage.prompt_tokens == rest["usage"]["prompt_tokens"]


def test_tgi_markdown_image_over_rest(served):
    _server, gateway = served
    inputs = f"USER: ![]({data_uri(image_bytes(RED))})\nwhat is in this image ASSISTANT:"
    body = json.loads(
        gateway.curl("/generate", body={"inputs": inputs, "parameters": {"max_new_tokens": 5, "details": True}})
    )
    assert body["details"]["generated_tokens"] == 5


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "not an image"),
        ([{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}], "could not be fetched"),
        ([{"type": "image_url", "image_url": {"url": data_uri(image_bytes(RED))}}] * 3, "at most 2 images"),
        ([{"type": "image_url", "image_url": {"url": data_uri(noise_png(100))}}], "allowed"),
    ],
    ids=["not-an-image", "unreachable", "too-many", "oversized"],
)
def test_bad_image_inputs_are_400_naming_the_problem(served, content, message):
    _server, gateway = served
    raw = gateway.curl(
        "/v1/chat/completions",
        "-w",
        "\n%{http_code}",
        body={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
    )
    body, status = raw.rsplit("\n", 1)
    assert status == "400", body  # OpenAI's invalid_request_error
    assert message in json.loads(body)["error"]["message"]


def test_an_oversized_url_is_refused(served):
    _server, gateway = served
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with (
        serving({"/big.png": noise_png(100)}) as base,
        pytest.raises(openai.BadRequestError, match=f"more than the {MAX_FETCH}"),
    ):
        client.chat.completions.create(model="m", messages=image_message(f"{base}/big.png"), max_tokens=2)


def test_a_text_only_model_refuses_images(tiny_chat_grpc_server, start_gateway):
    gateway = start_gateway(tiny_chat_grpc_server)
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=r"\(llama\) is text-only"):
        client.chat.completions.create(model="m", messages=image_message(data_uri(image_bytes(RED))), max_tokens=2)


def test_huggingface_hub_and_the_typed_client_send_images(served):
    from huggingface_hub import InferenceClient

    from textgen_client import Client

    server, gateway = served
    messages = image_message(data_uri(image_bytes(RED)))
    expected = server.stub.ChatCompletion(
        pb.ChatCompletionRequest(
            model="m",
            max_tokens=6,
            temperature=0,
            messages=[pb.ChatMessage(role="user", images=[pb.ImageData(data=image_bytes(RED))])],
        ),
        timeout=60,
    )
    hub = InferenceClient(base_url=gateway.url, timeout=60).chat_completion(messages, max_tokens=6, temperature=0)
    with Client(f"127.0.0.1:{server.port}", timeout=60) as client:
        typed = client.chat(messages, max_tokens=6, temperature=0)
    # The image alone (typed bytes) and the image with a question differ; the two clients agree.
    assert hub.choices[0].message.content == typed.choices[0].message.content
    assert hub.usage.prompt_tokens == typed.usage.prompt_tokens > expected.usage.prompt_tokens
