"""PaliGemma and Gemma 3 on the paged path: their image tokens attend both ways (PaliGemma's whole
prompt is a prefix-LM span, each Gemma 3 image a block). Greedy output token-identical to
transformers' `generate` given the same processor outputs (its `token_type_ids` included), with one
and two images, staggered arrivals, chunk budgets that would cut an image (the chunk stops before
it instead), preemption, and a second turn reusing the first's blocks; logprobs within 1e-4."""

from __future__ import annotations

import asyncio

import pytest
import torch

from inference_service.engine.builder import build_engine
from tests.integration.test_vision_models import BLUE, GREEN, RED, chat_request, chat_tokens, llava_config, run
from tests.tiny_vision_gemma import save_gemma3, save_paligemma
from tests.vision_reference import greedy_reference


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    return save_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def paligemma_dir(tmp_path_factory):
    return save_paligemma(tmp_path_factory.mktemp("tiny-paligemma"))


def reference_for(folder):
    """transformers' greedy generate on the engine's prompt and pixels, with the token types the
    processor gives (1: an image's soft token for Gemma 3; 0: PaliGemma's prefix)."""

    def inputs(model, request, ids):
        types = torch.zeros_like(ids)
        if model.config.model_type == "gemma3":
            for image in request.images:
                types[0, list(image.positions)] = 1
        return {"token_type_ids": types, "pixel_values": torch.cat([image.pixel_values for image in request.images])}

    return greedy_reference(folder, inputs)


def staggered_pair(engine, two, one):
    """`two` streams; `one` arrives while it decodes. Each request with its tokens and logprobs."""

    async def staggered(engine, front_end):
        _, [first] = await front_end.chat(two, stream=False)
        _, [second] = await front_end.chat(one, stream=False)
        first_tokens = []
        async for output in engine.generate_stream(first):
            first_tokens += output.tokens
            if len(first_tokens) == 2:  # the second arrives while the first decodes
                later = asyncio.ensure_future(engine.generate(second))
        second_result = await later
        return (first, first_tokens), (second, list(second_result.tokens))

    return run(engine, staggered)


def assert_matches(reference, request, tokens) -> None:
    """Token-identical, and each token's logprob within 1e-4 (a causal mask over the image moves them)."""
    expected_tokens, expected_logprobs = reference(request, with_logprobs=True)
    assert [token.id for token in tokens] == expected_tokens
    assert max(abs(t.logprob - e) for t, e in zip(tokens, expected_logprobs, strict=True)) < 1e-4


def test_gemma3_images_attend_both_ways_and_match_transformers(gemma3_dir):
    """A 6-token budget would cut each 4-token image: its chunk stops before it, the next runs it whole."""
    engine = build_engine(llava_config(gemma3_dir, prefill=6))
    reference = reference_for(gemma3_dir)
    two = chat_request(["compare", RED, "with", BLUE, "please"], max_tokens=16)
    one = chat_request([GREEN, "describe the picture"])
    (first, first_tokens), (second, second_tokens) = staggered_pair(engine, two, one)
    assert engine.info.vision_architecture == "gemma3"
    assert [image.span for image in first.images] == [(i.positions[0], i.positions[-1] + 1) for i in first.images]
    assert_matches(reference, first, first_tokens)
    assert_matches(reference, second, second_tokens)


def test_paligemma_prefix_attends_both_ways_and_matches_transformers(paligemma_dir):
    """The whole prompt is one both-way span: a 20-token budget runs it in one chunk past the budget."""
    engine = build_engine(llava_config(paligemma_dir))
    reference = reference_for(paligemma_dir)
    two = chat_request([RED, BLUE, "compare them"], max_tokens=16)
    one = chat_request([GREEN, "describe the picture"])
    (first, first_tokens), (second, second_tokens) = staggered_pair(engine, two, one)
    assert engine.info.vision_architecture == "paligemma"
    assert len(first.images) == 2 and first.images[0].span == (0, len(first.prompt_token_ids))
    assert len(first.prompt_token_ids) > 20  # longer than the step's budget
    assert_matches(reference, first, first_tokens)
    assert_matches(reference, second, second_tokens)


def test_gemma3_follow_up_reuses_the_image_and_preemption_recomputes_it(gemma3_dir):
    """A second turn reuses the first's image blocks; a pool too small for all requests preempts
    some, recomputed with their images' spans whole."""
    engine = build_engine(llava_config(gemma3_dir, num_tokens=160, prefill=6, max_total=150))
    reference = reference_for(gemma3_dir)
    turn = [(90, 40, 160), "what is in this image"]
    colours = [RED, BLUE, GREEN, (200, 200, 20)]

    async def turns_then_crowd(engine, front_end):
        first = await chat_tokens(engine, front_end, chat_request(turn))
        hits_before = engine.stats().num_prefix_hit_tokens
        second = await chat_tokens(engine, front_end, chat_request(turn, "a thing", ["and its colour"]))
        hits = engine.stats().num_prefix_hit_tokens - hits_before
        crowd = await asyncio.gather(
            *(chat_tokens(engine, front_end, chat_request([c, "describe"], max_tokens=24)) for c in colours)
        )
        return first, second, hits, crowd

    first, second, hits, crowd = run(engine, turns_then_crowd)
    assert hits >= first[0].images[0].positions[-1] + 1  # the image's blocks were reused
    assert engine.scheduler.num_preemptions > 0
    for request, tokens in (first, second, *crowd):
        assert tokens == reference(request)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_paligemma_reuses_a_prefix_only_when_the_whole_prefix_matches(paligemma_dir):
    """PaliGemma's image tokens read the text after them: the same image with other text reuses nothing."""
    engine = build_engine(llava_config(paligemma_dir))
    reference = reference_for(paligemma_dir)
    same = chat_request([RED, "what is in this image"])
    other_text = chat_request([RED, "what colour is this image"])

    async def three(engine, front_end):
        results, hits = [], []
        for request in (same, same, other_text):
            before = engine.stats().num_prefix_hit_tokens
            results.append(await chat_tokens(engine, front_end, request))
            hits.append(engine.stats().num_prefix_hit_tokens - before)
        return results, hits

    results, hits = run(engine, three)
    assert hits[1] >= len(results[0][0].prompt_token_ids) - 4  # the same prompt again: its full blocks reused
    assert hits[2] == 0  # same image, other text: none (its K/V differ)
    for request, tokens in results:
        assert tokens == reference(request)
