"""Mllama (cross-attention to the image) on the fallback path: transformers' model code with one
cache per request, the image's K/V kept in its cross-attention layers. Greedy output
token-identical to transformers' `generate` on the same processor outputs (logprobs within 1e-4),
with one and two images, staggered arrivals, 20-token prompt chunks (the image encoded in the
first), decode rows batched, preemption, and a text-only request beside them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.engine.builder import build_engine
from inference_service.errors import ValidationError
from tests.image_server import data_uri, image_bytes
from tests.integration.test_vision_both_ways import staggered_pair
from tests.integration.test_vision_models import (
    BLUE,
    GREEN,
    RED,
    assert_preempted_crowd_matches,
    chat_request,
    chat_tokens,
    llava_config,
    run,
)
from tests.tiny_vision_mllama import save_mllama
from tests.vision_reference import greedy_reference
from textgen.v1 import generate_pb2 as pb

# How the processor's per-image tensors are batched: along this axis (cross_attention_mask: [1, prompt, images, tiles]).
IMAGE_AXES = {"aspect_ratio_ids": 1, "aspect_ratio_mask": 1, "cross_attention_mask": 2}


@pytest.fixture(scope="module")
def mllama_dir(tmp_path_factory):
    return save_mllama(tmp_path_factory.mktemp("tiny-mllama"))


@pytest.fixture(scope="module")
def mllama_engine(mllama_dir):
    return build_engine(llava_config(mllama_dir))


@pytest.fixture(scope="module")
def reference(mllama_dir):
    """transformers' greedy generate on the request's processor outputs (its images put back together)."""

    def images(model, request, ids) -> dict:
        if not request.images:
            return {}
        found = {"pixel_values": torch.cat([image.pixel_values for image in request.images], dim=1)}
        for name, axis in IMAGE_AXES.items():
            found[name] = torch.cat([image.extras[name] for image in request.images], dim=axis)
        return found

    return greedy_reference(mllama_dir, images)


def assert_matches(reference, request, tokens) -> None:
    expected_tokens, expected_logprobs = reference(request, with_logprobs=True)
    assert [token.id for token in tokens] == expected_tokens
    assert max(abs(t.logprob - e) for t, e in zip(tokens, expected_logprobs, strict=True)) < 1e-4


def test_mllama_is_served_by_the_fallback_path_and_says_so(mllama_engine):
    info = mllama_engine.info
    assert info.vision_architecture == "mllama"
    assert info.attention_impl == "transformers"
    assert not info.prefix_caching  # the fallback's per-request caches share nothing


def test_one_and_two_images_staggered_and_chunked_match_transformers(mllama_engine, reference):
    two = chat_request(["compare", (RED, (70, 30)), "with", (BLUE, (30, 30)), "please"], max_tokens=16)
    one = chat_request([(GREEN, (40, 40)), "describe the picture in a few words"])
    (first, first_tokens), (second, second_tokens) = staggered_pair(mllama_engine, two, one)
    assert len(first.images) == 2 and len(second.images) == 1
    assert first.num_prompt_tokens > 20  # the 20-token chunks cut the prompt
    assert_matches(reference, first, first_tokens)
    assert_matches(reference, second, second_tokens)


def test_the_image_moves_the_output(mllama_engine, reference):
    """Different images, same text: different greedy tokens (the cross-attention is really read)."""

    async def both(engine, front_end):
        return [await chat_tokens(engine, front_end, chat_request([c, "describe"])) for c in (RED, (20, 200, 200))]

    (red, red_tokens), (cyan, cyan_tokens) = run(mllama_engine, both)
    assert red.prompt_token_ids == cyan.prompt_token_ids
    assert red_tokens != cyan_tokens
    assert red_tokens == reference(red) and cyan_tokens == reference(cyan)


def test_decode_rows_batch_and_text_only_requests_run_beside_them(mllama_engine, reference):
    colours = [RED, BLUE, GREEN]

    async def crowd(engine, front_end):
        """Processed first, then admitted together (as OpenAI's `n` is), so the image requests decode together."""
        chats = [chat_request([c, "describe"], max_tokens=10) for c in colours]
        chats.append(chat_request(["describe the quick brown fox"], max_tokens=10))
        requests = [(await front_end.chat(chat, stream=False))[1][0] for chat in chats]
        results = await engine.generate_all(requests)
        return [(r, [token.id for token in result.tokens]) for r, result in zip(requests, results, strict=True)]

    before = mllama_engine.runner.num_batched_rows
    results = run(mllama_engine, crowd)
    assert mllama_engine.runner.num_batched_rows > before  # same-length image requests decoded together
    assert not results[-1][0].images
    for request, tokens in results:
        assert tokens == reference(request)
    assert mllama_engine.runner.num_caches == 0


def test_preempted_mllama_requests_match_transformers(mllama_dir, reference):
    """A pool too small for all of them: requests are preempted and recomputed, images encoded again."""
    engine = build_engine(llava_config(mllama_dir, num_tokens=96, prefill=64, max_total=64))
    assert_preempted_crowd_matches(engine, reference)


def test_too_many_images_are_refused_and_tgi_markdown_images_are_served(mllama_dir, reference):
    config = llava_config(mllama_dir)
    limits = dataclasses.replace(config.limits, max_images_per_request=1)
    engine = build_engine(dataclasses.replace(config, limits=limits))
    inputs = f"User:![]({data_uri(image_bytes(BLUE))})what is in this image<|eot_id|>\nAssistant:"
    markdown = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(max_new_tokens=8))

    async def attempt(engine, front_end):
        with pytest.raises(ValidationError, match=r"at most 1 images per request"):
            await front_end.chat(chat_request([RED, "and", BLUE]), stream=False)
        validated = await front_end.generate(markdown, stream=False)  # the engine still serves
        result = await engine.generate(validated.engine_request)
        return validated.engine_request, [token.id for token in result.tokens]

    request, tokens = run(engine, attempt)
    assert len(request.images) == 1
    assert tokens == reference(request)


def test_speculation_keeps_the_image_through_rejected_guesses(mllama_dir, reference):
    """n-gram guesses verified on image prompts: a rejected guess cuts the text K/V back, never the
    image's K/V in the cross-attention layers."""
    config = llava_config(mllama_dir)
    engine = build_engine(dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, speculate=3)))

    async def both(engine, front_end):
        return [await chat_tokens(engine, front_end, chat_request([c, "describe"], max_tokens=24)) for c in (RED, BLUE)]

    for request, tokens in run(engine, both):
        assert tokens == reference(request)
    assert engine.num_accepted_tokens > 0
    assert engine.num_draft_tokens > engine.num_accepted_tokens  # some guesses were rejected and cut back
