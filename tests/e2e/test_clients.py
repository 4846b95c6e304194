"""TGI's official clients, unchanged, against Envoy: `text-generation` (Client, AsyncClient) and
`huggingface_hub.InferenceClient`. Their answers must equal the same call over gRPC."""

from __future__ import annotations

import json
import re
import warnings

import jsonschema
import pytest

from textgen.v1 import generate_pb2 as pb

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # the package says it is deprecated
    import text_generation

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # text-generation's pydantic v1 calls

PROMPT = "the quick brown fox"
SAMPLING = {"do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 7}


def grpc_generate(server, **parameters) -> pb.GenerateResponse:
    request = pb.GenerateRequest(inputs=PROMPT, parameters=pb.GenerateParameters(details=True, **parameters))
    return server.stub.Generate(request, timeout=60)


def grpc_token_ids(server, **parameters) -> list[int]:
    return [t.id for t in grpc_generate(server, **parameters).details.tokens]


@pytest.mark.parametrize("sampling", [{}, SAMPLING], ids=["greedy", "seeded"])
def test_text_generation_client(gateway, sampling):
    client = text_generation.Client(gateway.url, timeout=60)
    response = client.generate(PROMPT, max_new_tokens=8, **sampling)
    expected = grpc_generate(gateway.server, max_new_tokens=8, return_full_text=False, **sampling)
    assert response.generated_text == expected.generated_text
    assert [t.id for t in response.details.tokens] == [t.id for t in expected.details.tokens]
    assert [t.logprob for t in response.details.tokens] == pytest.approx(
        [t.logprob for t in expected.details.tokens], abs=1e-6
    )
    assert response.details.finish_reason.value == expected.details.finish_reason
    assert response.details.seed == (sampling["seed"] if sampling else None)

    events = list(client.generate_stream(PROMPT, max_new_tokens=8, **sampling))
    assert [e.token.id for e in events] == [t.id for t in expected.details.tokens]
    assert events[-1].generated_text == expected.generated_text
    assert events[-1].details.generated_tokens == len(events)


async def test_text_generation_async_client(gateway):
    client = text_generation.AsyncClient(gateway.url, timeout=60)
    response = await client.generate(PROMPT, max_new_tokens=6, decoder_input_details=True, top_n_tokens=2)
    assert response.details.prefill[0].logprob is None and len(response.details.prefill) > 1
    assert len(response.details.top_tokens) == len(response.details.tokens) == 6
    events = [event async for event in client.generate_stream(PROMPT, max_new_tokens=6, top_n_tokens=2)]
    assert [e.token.id for e in events] == [t.id for t in response.details.tokens]
    assert all(len(e.top_tokens) >= 2 for e in events)


def test_text_generation_validation_errors(gateway):
    client = text_generation.Client(gateway.url, timeout=60)
    # top_p=1.0 is refused by the client's own checks before anything is sent...
    with pytest.raises(text_generation.errors.ValidationError, match="top_p"):
        client.generate(PROMPT, top_p=1.0)
    # ...so the server's 422 is checked with a rule only the server knows.
    with pytest.raises(text_generation.errors.ValidationError, match="top_n_tokens"):
        client.generate(PROMPT, max_new_tokens=2, top_n_tokens=100)
    with pytest.raises(text_generation.errors.ValidationError, match="top_n_tokens"):
        list(client.generate_stream(PROMPT, max_new_tokens=2, top_n_tokens=100))
    # The client sends a JSON schema as an object: it must reach validation (422), not fail transcoding.
    schema = text_generation.types.Grammar(
        type=text_generation.types.GrammarType.Json, value={"properties": {"a": {"type": "nope"}}}
    )
    with pytest.raises(text_generation.errors.ValidationError, match="grammar is not valid: Invalid type: nope"):
        client.generate(PROMPT, max_new_tokens=2, grammar=schema)


def test_text_generation_grammars_constrain_the_output(gateway):
    client = text_generation.Client(gateway.url, timeout=60)
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["a", "b"]}},
        "required": ["id", "kind"],
        "additionalProperties": False,
    }
    response = client.generate(
        PROMPT,
        max_new_tokens=60,
        grammar=text_generation.types.Grammar(type=text_generation.types.GrammarType.Json, value=schema),
    )
    jsonschema.validate(json.loads(response.generated_text), schema)
    assert response.details.finish_reason == "eos_token"
    response = client.generate(
        PROMPT,
        max_new_tokens=60,
        grammar=text_generation.types.Grammar(
            type=text_generation.types.GrammarType.Regex, value="[0-9]{3}-[a-z]{2,4}"
        ),
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2,4}", response.generated_text), response.generated_text


async def test_text_generation_async_validation_errors(gateway):
    client = text_generation.AsyncClient(gateway.url, timeout=60)
    with pytest.raises(text_generation.errors.ValidationError, match="stop"):
        await client.generate(PROMPT, max_new_tokens=2, stop_sequences=["a", "b", "c", "d", "e"])
    with pytest.raises(text_generation.errors.ValidationError, match="stop"):
        async for _ in client.generate_stream(PROMPT, max_new_tokens=2, stop_sequences=list("abcde")):
            pass


def test_inference_client(gateway):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=gateway.url, timeout=60)
    expected = grpc_generate(gateway.server, max_new_tokens=8, return_full_text=False)
    text = client.text_generation(PROMPT, max_new_tokens=8, return_full_text=False)
    assert text == expected.generated_text

    output = client.text_generation(PROMPT, max_new_tokens=8, details=True, return_full_text=False)
    assert output.generated_text == expected.generated_text
    assert [t.id for t in output.details.tokens] == [t.id for t in expected.details.tokens]
    assert output.details.finish_reason == expected.details.finish_reason

    streamed = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, return_full_text=False))
    assert "".join(streamed) == "".join(t.text for t in expected.details.tokens)

    events = list(client.text_generation(PROMPT, max_new_tokens=8, stream=True, details=True))
    assert [e.token.id for e in events] == [t.id for t in expected.details.tokens]
    assert events[-1].details.generated_tokens == 8 or events[-1].details.finish_reason == "eos_token"


def test_inference_client_errors(gateway):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import ValidationError

    client = InferenceClient(model=gateway.url, timeout=60)
    with pytest.raises(ValidationError, match="top_p"):
        client.text_generation(PROMPT, top_p=1.0)
    with pytest.raises(ValidationError, match="top_p"):
        list(client.text_generation(PROMPT, top_p=1.0, stream=True))


def test_inference_client_endpoint_info_and_health(gateway):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=gateway.url, provider="hf-inference", timeout=60)
    assert client.get_endpoint_info()["model_id"] == gateway.server.engine.info.model_id
    assert client.health_check()
