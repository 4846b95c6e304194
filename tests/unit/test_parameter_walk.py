"""temperature and max_new_tokens walked from each API's message to the sampler.

Each surface's request (TGI's gRPC `Generate`, which Envoy's REST routes transcode to; OpenAI chat and
completions; Responses; Anthropic Messages) goes through the real front end (conversion, chat
template, tokenization, validation) to the engine's `EngineRequest`, whose sampling parameters the
real sampler then applies. Given values arrive unchanged; absent ones take `frontend.defaults`' value,
decided there once; OpenAI's temperature 0 is greedy by an explicit rule, TGI's is refused.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from google.protobuf import json_format

from inference_service.errors import ValidationError
from inference_service.frontend import defaults, responses
from inference_service.frontend.front_end import FrontEnd
from inference_service.sample.sampler import Sampler, SamplingState
from inference_service.sampling_params import EngineRequest
from tests.unit.test_validation import engine_info
from textgen.v1 import anthropic_pb2 as apb
from textgen.v1 import generate_pb2 as pb

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT = "the quick brown fox"
MAX_TOTAL = 200


@pytest.fixture
def front_end(byte_tokenizer, byte_grammar_compiler):
    info = engine_info(max_input_tokens=100, max_total_tokens=MAX_TOTAL)
    return FrontEnd(info, byte_tokenizer, byte_grammar_compiler, CHATML, rng=random.Random(3))


def walk(front_end: FrontEnd, surface: str, **fields) -> EngineRequest:
    """The one engine request a surface's message becomes; `fields`: temperature and the surface's
    own name for the output length (`max_tokens`)."""
    temperature = {"temperature": fields["temperature"]} if "temperature" in fields else {}
    limit = fields.get("max_tokens")
    chat = {"messages": [{"role": "user", "content": PROMPT}], **temperature}
    if surface == "tgi":
        parameters = {**temperature, **({"max_new_tokens": limit} if limit is not None else {})}
        message = json_format.ParseDict({"inputs": PROMPT, "parameters": parameters}, pb.GenerateRequest())
        return asyncio.run(front_end.generate(message, stream=False)).engine_request
    if surface == "chat":
        message = json_format.ParseDict({**chat, **_given("max_completion_tokens", limit)}, pb.ChatCompletionRequest())
        return _one(asyncio.run(front_end.chat(message, stream=False))[1])
    if surface == "completions":
        body = {"prompt": PROMPT, **temperature, **_given("max_tokens", limit)}
        return _one(asyncio.run(front_end.completion(json_format.ParseDict(body, pb.CompletionRequest())))[1])
    if surface == "responses":
        body = {"input": PROMPT, **temperature, **_given("max_output_tokens", limit)}
        chat_message, _ = responses.chat_request(json_format.ParseDict(body, responses.rpb.CreateResponseRequest()), [])
        return _one(asyncio.run(front_end.chat(chat_message, stream=False))[1])
    assert surface == "anthropic"
    message = json_format.ParseDict({**chat, "max_tokens": limit or 7}, apb.MessagesRequest())
    return _one(asyncio.run(front_end.messages(message, stream=False))[1])


def _given(name: str, value: int | None) -> dict:
    return {name: value} if value is not None else {}


def _one(requests: list[EngineRequest]) -> EngineRequest:
    assert len(requests) == 1
    return requests[0]


SURFACES = ["tgi", "chat", "completions", "responses", "anthropic"]


@pytest.mark.parametrize("surface", SURFACES)
def test_given_values_reach_the_sampler_unchanged(front_end, byte_tokenizer, surface):
    request = walk(front_end, surface, temperature=0.5, max_tokens=5)
    assert request.stopping.max_new_tokens == 5
    assert request.sampling.do_sample and request.sampling.temperature == 0.5
    vocab_size = len(byte_tokenizer)
    logits = torch.randn(1, vocab_size, generator=torch.Generator().manual_seed(0))
    state = SamplingState(request.sampling, request.prompt_token_ids, vocab_size)
    # The sampler divides by the request's temperature, and nothing else changes the row.
    torch.testing.assert_close(Sampler(vocab_size).process(logits, [state]), logits / 0.5)


@pytest.mark.parametrize(
    ("surface", "do_sample", "max_new_tokens"),
    [
        ("tgi", False, defaults.TGI_MAX_NEW_TOKENS),
        ("chat", True, defaults.CHAT_MAX_NEW_TOKENS),
        ("completions", True, defaults.COMPLETION_MAX_NEW_TOKENS),
        ("responses", True, defaults.CHAT_MAX_NEW_TOKENS),  # a chat request in other shapes
    ],
)
def test_absent_values_take_the_documented_defaults(front_end, surface, do_sample, max_new_tokens):
    request = walk(front_end, surface)
    assert request.sampling.do_sample is do_sample
    assert request.sampling.temperature == (defaults.OPENAI_TEMPERATURE if do_sample else 1.0)
    # None: what fits in the context after the prompt.
    fits = MAX_TOTAL - len(request.prompt_token_ids)
    assert request.stopping.max_new_tokens == (fits if max_new_tokens is None else max_new_tokens)


def test_anthropic_requires_max_tokens_and_samples_at_openai_s_default(front_end):
    request = walk(front_end, "anthropic", max_tokens=3)
    assert request.sampling.do_sample and request.sampling.temperature == defaults.OPENAI_TEMPERATURE
    with pytest.raises(ValidationError, match="max_tokens"):
        asyncio.run(
            front_end.messages(
                json_format.ParseDict({"messages": [{"role": "user", "content": "hi"}]}, apb.MessagesRequest()),
                stream=False,
            )
        )


@pytest.mark.parametrize("surface", ["chat", "completions", "responses", "anthropic"])
def test_openai_style_temperature_zero_is_greedy(front_end, surface):
    request = walk(front_end, surface, temperature=0.0, max_tokens=4)
    assert not request.sampling.do_sample and request.sampling.is_greedy
    assert request.sampling.temperature == 1.0  # a greedy row's argmax is the same at any temperature


def test_tgi_temperature_zero_is_refused(front_end):
    with pytest.raises(ValidationError, match="temperature"):
        walk(front_end, "tgi", temperature=0.0, max_tokens=4)
