"""A served encoder-decoder (a tiny random M2M100 whose generation config names a default target
language) through gRPC and through Envoy's REST: the seed's translation client (many threads
posting to `/`), streaming, details, a per-request target language, and `/info`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig
from tests.e2e.rest_helpers import sse_events
from tests.tiny_seq2seq import save_model, seq2seq_config
from textgen.v1 import generate_pb2 as pb
from textgen_client import Client, ValidationError

SENTENCES = [
    "the quick brown fox",
    "jumps over the lazy dog",
    "a",
    "café naïve",
    "runs home at night",
    "the dog and the fox",
    "over",
    "quick quick brown",
]


@pytest.fixture(scope="module")
def translator(tmp_path_factory, byte_tokenizer):
    """(folder, default target-language id, another language's token)."""
    language = byte_tokenizer.convert_tokens_to_ids("<|im_start|>")
    folder = save_model(
        seq2seq_config("m2m_100", byte_tokenizer),
        byte_tokenizer,
        tmp_path_factory.mktemp("m2m100"),
        forced_bos_token_id=language,
    )
    return folder, language, "<|im_end|>"


@pytest.fixture(scope="module")
def served(translator, start_grpc_server, start_gateway):
    folder, _, _ = translator
    config = EngineConfig(
        model=ModelConfig(model_id=str(folder), device="cpu", dtype="float32"),
        cache=CacheConfig(max_batch_total_tokens=2048),
        limits=LimitsConfig(max_total_tokens=96),
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


def _greedy_reference(folder, token_ids: list[int], max_new_tokens: int) -> list[int]:
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([token_ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, 1:].tolist()


def test_grpc_generates_what_transformers_does_and_streams_it(served, translator, byte_tokenizer):
    server, _gateway = served
    folder, language, _ = translator
    info = server.stub.Info(pb.InfoRequest(), timeout=10)
    assert (info.model_pipeline_tag, info.attention_impl) == ("text2text-generation", "transformers")
    request = pb.GenerateRequest(
        inputs=SENTENCES[0],
        parameters=pb.GenerateParameters(max_new_tokens=10, details=True, decoder_input_details=True),
    )
    unary = server.stub.Generate(request, timeout=60)
    expected = _greedy_reference(folder, byte_tokenizer.encode(SENTENCES[0]), 10)
    assert [t.id for t in unary.details.tokens] == expected and expected[0] == language
    assert (
        unary.details.prefill[0].id
        == AutoModelForSeq2SeqLM.from_pretrained(folder).generation_config.decoder_start_token_id
    )
    streamed = list(
        server.stub.GenerateStream(
            pb.GenerateRequest(inputs=SENTENCES[0], parameters=pb.GenerateParameters(max_new_tokens=10)), timeout=60
        )
    )
    assert [m.token.id for m in streamed] == expected
    assert streamed[-1].generated_text == unary.generated_text


def test_many_threads_posting_to_the_root_route_as_the_translation_client_does(served):
    server, gateway = served
    expected = {
        s: server.stub.Generate(
            pb.GenerateRequest(inputs=s, parameters=pb.GenerateParameters(max_new_tokens=12)), timeout=60
        ).generated_text
        for s in SENTENCES
    }

    def translate(sentence: str) -> tuple[str, list]:
        return sentence, json.loads(gateway.curl("/", body={"inputs": sentence, "parameters": {"max_new_tokens": 12}}))

    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(translate, SENTENCES * 4))
    for sentence, body in answers:
        # A JSON array of one, and no input prepended: `/` defaults return_full_text to false for a
        # text2text-generation model, as TGI does.
        assert isinstance(body, list) and len(body) == 1
        assert body[0]["generated_text"] == expected[sentence]
    streamed = sse_events(
        gateway.curl("/", body={"inputs": SENTENCES[1], "stream": True, "parameters": {"max_new_tokens": 12}})
    )
    assert streamed[-1]["generated_text"] == expected[SENTENCES[1]]


def test_a_request_names_its_target_language(served, translator):
    _server, gateway = served
    _, language, other = translator
    body = json.loads(
        gateway.curl(
            "/generate",
            body={
                "inputs": SENTENCES[1],
                "parameters": {"max_new_tokens": 6, "details": True, "forced_bos_token": other},
            },
        )
    )
    assert body["details"]["tokens"][0]["text"] == other
    default = json.loads(
        gateway.curl("/generate", body={"inputs": SENTENCES[1], "parameters": {"max_new_tokens": 6, "details": True}})
    )
    assert default["details"]["tokens"][0]["id"] == language
    refused = gateway.curl(
        "/generate", "-i", body={"inputs": SENTENCES[1], "parameters": {"forced_bos_token": "__xx__"}}
    )
    assert " 422 " in refused.splitlines()[0] and "forced_bos_token" in refused
    info = json.loads(gateway.curl("/info"))
    assert info["model_pipeline_tag"] == "text2text-generation"


def test_the_typed_client_names_a_target_language(served, translator):
    server, _gateway = served
    _, language, other = translator
    with Client(server.target) as client:
        chosen = client.generate(SENTENCES[2], max_new_tokens=4, forced_bos_token=other)
        streamed = list(client.generate_stream(SENTENCES[2], max_new_tokens=4, forced_bos_token=other))
        default = client.generate(SENTENCES[2], max_new_tokens=4)
        with pytest.raises(ValidationError, match="forced_bos_token"):
            client.generate(SENTENCES[2], forced_bos_token="__xx__")
    assert chosen.details.tokens[0].text == other and streamed[0].token.text == other
    assert default.details.tokens[0].id == language


def test_openai_completions_count_the_encoders_input_as_the_prompt(served, byte_tokenizer):
    _server, gateway = served
    body = json.loads(
        gateway.curl("/v1/completions", body={"model": "m2m100", "prompt": SENTENCES[4], "max_tokens": 5, "seed": 3})
    )
    assert body["usage"]["prompt_tokens"] == len(byte_tokenizer.encode(SENTENCES[4]))
    assert 1 <= body["usage"]["completion_tokens"] <= 5


def test_sampling_and_details_through_rest(served):
    server, gateway = served
    parameters = {"max_new_tokens": 8, "do_sample": True, "seed": 11, "top_k": 30, "details": True, "top_n_tokens": 2}
    rest = json.loads(gateway.curl("/generate", body={"inputs": SENTENCES[3], "parameters": parameters}))
    grpc_reply = server.stub.Generate(
        pb.GenerateRequest(inputs=SENTENCES[3], parameters=pb.GenerateParameters(**parameters)), timeout=60
    )
    assert rest["generated_text"] == grpc_reply.generated_text and rest["details"]["seed"] == 11
    assert all(len(top) == 2 for top in rest["details"]["top_tokens"])
