"""LoRA adapters through Envoy, as TGI's and vLLM's users call them: `adapter_id` on /generate,
OpenAI's `model` on /v1/completions (and the OpenAI SDK), /v1/models with each adapter's parent,
an unknown adapter a 404 (OpenAI's error shape on /v1 routes) naming the loaded ones, and vLLM's
/v1/load_lora_adapter and /v1/unload_lora_adapter behind the API key."""

from __future__ import annotations

import dataclasses
import json

import pytest
from rest_helpers import status_and_body

from tests.conftest import GrpcServerThread
from tests.lora_adapters import make_adapter

KEY = "lora-s3cret"
AUTH = ("-H", f"Authorization: Bearer {KEY}")


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "alpha": make_adapter(tiny_model_dir, root / "alpha", seed=1),
        "beta": make_adapter(tiny_model_dir, root / "beta", seed=2, rank=4, targets=["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
def lora_gateway(tiny_engine_config, adapter_dirs, start_gateway):
    model = dataclasses.replace(tiny_engine_config.model, lora_adapters=f"alpha={adapter_dirs['alpha']}", max_loras=2)
    server = GrpcServerThread(dataclasses.replace(tiny_engine_config, model=model), api_key=KEY)
    yield start_gateway(server)
    server.stop(timeout_s=1.0)


def _post(gateway, path: str, body: dict) -> tuple[int, dict]:
    status, _, text = status_and_body(gateway.curl(path, "-i", *AUTH, body=body))
    return status, json.loads(text)


def test_generate_and_completions_pick_the_adapter(lora_gateway):
    base_id = lora_gateway.server.engine.info.model_id
    generate = {"inputs": "the quick brown fox", "parameters": {"max_new_tokens": 8}}
    _, base = _post(lora_gateway, "/generate", generate)
    with_adapter = {**generate, "parameters": {"max_new_tokens": 8, "adapter_id": "alpha"}}
    _, adapted = _post(lora_gateway, "/generate", with_adapter)
    assert adapted["generated_text"] != base["generated_text"]
    completion = {"model": "alpha", "prompt": "the quick brown fox", "max_tokens": 8, "temperature": 0}
    status, answer = _post(lora_gateway, "/v1/completions", completion)
    assert status == 200 and answer["model"] == "alpha" and answer["choices"][0]["text"] == adapted["generated_text"]
    status, answer = _post(lora_gateway, "/v1/completions", {**completion, "model": base_id})
    assert answer["choices"][0]["text"] == base["generated_text"]


def test_unknown_adapters_are_404_naming_the_loaded_ones(lora_gateway):
    status, body = _post(
        lora_gateway, "/generate", {"inputs": "a", "parameters": {"max_new_tokens": 2, "adapter_id": "nope"}}
    )
    assert status == 404 and body["error_type"] == "not_found" and "'alpha'" in body["error"]
    status, body = _post(lora_gateway, "/v1/completions", {"model": "nope", "prompt": "a", "max_tokens": 2})
    message = body["error"]["message"]
    assert status == 404 and "'nope' does not exist" in message and "'alpha'" in message


def test_models_list_adapters_with_their_parent(lora_gateway, adapter_dirs):
    base_id = lora_gateway.server.engine.info.model_id
    cards = json.loads(lora_gateway.curl("/v1/models"))["data"]
    assert [(c["id"], c.get("parent")) for c in cards] == [(base_id, None), ("alpha", base_id)]
    assert cards[1]["root"] == str(adapter_dirs["alpha"])
    info = json.loads(lora_gateway.curl("/info"))
    assert info["lora_adapters"] == [{"id": "alpha", "source": str(adapter_dirs["alpha"]), "rank": 8}]


def test_vllm_load_and_unload_routes(lora_gateway, adapter_dirs, tmp_path):
    load = {"lora_name": "beta", "lora_path": str(adapter_dirs["beta"])}
    status, _, _ = status_and_body(lora_gateway.curl("/v1/load_lora_adapter", "-i", body=load))
    assert status == 401  # the API key guards them
    status, body = _post(lora_gateway, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)})
    assert status == 400 and "no adapter_config.json" in body["error"]["message"]
    status, card = _post(lora_gateway, "/v1/load_lora_adapter", load)
    assert status == 200 and (card["id"], card["parent"]) == ("beta", lora_gateway.server.engine.info.model_id)
    status, answer = _post(lora_gateway, "/v1/completions", {"model": "beta", "prompt": "a", "max_tokens": 2})
    assert status == 200 and answer["model"] == "beta"
    status, body = _post(lora_gateway, "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert status == 200 and body == {"id": "beta", "object": "model", "deleted": True}
    status, body = _post(lora_gateway, "/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert status == 404 and "no LoRA adapter named 'beta'" in body["error"]["message"]


def test_the_openai_sdk_names_an_adapter(lora_gateway):
    import openai

    client = openai.OpenAI(base_url=lora_gateway.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model="alpha", prompt="a", max_tokens=3).model == "alpha"
    assert [m.id for m in client.models.list()][1] == "alpha"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=3)
