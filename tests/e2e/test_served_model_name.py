"""`--served-model-name` (vLLM's flag) names the model on every REST surface through Envoy: /info's
model_id, /v1/models and its card, the `model` of OpenAI responses (unary and streamed); the model
id it was loaded from appears nowhere."""

from __future__ import annotations

import dataclasses
import json

import pytest
from rest_helpers import status_and_body

from tests.conftest import GrpcServerThread

NAME = "acme/chat-v1"


@pytest.fixture(scope="module")
def named_gateway(tiny_chat_engine_config, start_gateway):
    model = dataclasses.replace(tiny_chat_engine_config.model, served_model_name=NAME)
    server = GrpcServerThread(dataclasses.replace(tiny_chat_engine_config, model=model))
    yield start_gateway(server)
    server.stop(timeout_s=1.0)


def test_every_surface_says_the_served_name(named_gateway, tiny_chat_engine_config):
    loaded_from = tiny_chat_engine_config.model.model_id
    assert json.loads(named_gateway.curl("/info"))["model_id"] == NAME
    [card] = json.loads(named_gateway.curl("/v1/models"))["data"]
    assert (card["id"], card["owned_by"]) == (NAME, NAME)
    assert json.loads(named_gateway.curl("/v1/models/acme%2Fchat-v1")) == card
    status, _, body = status_and_body(named_gateway.curl("/v1/models/" + loaded_from.lstrip("/"), "-i"))
    assert status == 404 and NAME in body

    chat = {"model": "anything", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert json.loads(named_gateway.curl("/v1/chat/completions", body=chat))["model"] == NAME
    completion = {"model": "anything", "prompt": "hi", "max_tokens": 2}
    assert json.loads(named_gateway.curl("/v1/completions", body=completion))["model"] == NAME
    events = named_gateway.curl("/v1/chat/completions", body={**chat, "stream": True}).split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert chunks and {chunk["model"] for chunk in chunks} == {NAME}


def test_a_model_name_with_percent_and_slash_through_the_openai_sdk(tiny_chat_engine_config, start_gateway):
    import openai

    name = "team/50%25-sale%"  # literally: a `%` before hex digits, and a lone one
    model = dataclasses.replace(tiny_chat_engine_config.model, served_model_name=name)
    server = GrpcServerThread(dataclasses.replace(tiny_chat_engine_config, model=model))
    try:
        client = openai.OpenAI(base_url=start_gateway(server).url + "/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve(name).id == name  # the SDK sends team%2F50%2525-sale%25
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("team/50%-sale%")
    finally:
        server.stop(timeout_s=1.0)
