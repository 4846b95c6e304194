"""Qwen2-VL and Qwen2.5-VL on the paged path: three rotary positions per token (M-RoPE), checked
as greedy output token-identical to transformers' `generate` on the same processor outputs, with
one and two images, staggered arrivals, chunked prefill cutting through an image, preemption, a
second turn reusing the image's blocks, and logprobs within 1e-4."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from inference_service.engine.builder import build_engine
from inference_service.engine.mrope import prompt_positions
from tests.image_server import data_uri, image_bytes
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
from tests.tiny_qwen_vl import VISION_END, VISION_START, save_qwen_vl
from tests.vision_reference import greedy_reference
from textgen.v1 import generate_pb2 as pb

FAMILIES = ["qwen2_vl", "qwen2_5_vl"]


# The families differ in their vision tower only: the positions' finer cases run on Qwen2-VL alone.
# The finer cases run on Qwen2-VL only (the families differ in their vision tower alone), and only
# with `pytest -m extended`: chunking, logprobs and two staggered images run on both by default.
def QWEN2_VL_ONLY(test):  # noqa: N802 (reads as a marker)
    return pytest.mark.extended(pytest.mark.parametrize("qwen", ["qwen2_vl"], indirect=True)(test))


@pytest.fixture(scope="module", params=FAMILIES)
def qwen(request, tmp_path_factory):
    """(engine, reference, folder) of one family: blocks of 4, 20-work-unit prefill steps."""
    folder = save_qwen_vl(tmp_path_factory.mktemp(request.param), request.param)
    return build_engine(llava_config(folder)), qwen_reference(folder), folder


def qwen_reference(folder):
    """Greedy tokens (and raw logprobs) of transformers on the processor outputs the engine ran:
    `generate` places the 3-D positions itself (`get_rope_index`, then `rope_deltas`)."""

    def inputs(model, request, ids):
        images = {}
        if request.images:
            images = {
                "pixel_values": torch.cat([image.pixel_values for image in request.images]),
                "image_grid_thw": torch.cat([image.extras["image_grid_thw"] for image in request.images]),
            }
        return {"mm_token_type_ids": (ids == model.config.image_token_id).int(), **images}

    return greedy_reference(folder, inputs)


def test_one_image_chunked_through_it_matches_transformers(qwen):
    engine, reference, _ = qwen
    requests = {colour: chat_request([colour, "what is in this image"]) for colour in (RED, BLUE)}

    async def both(engine, front_end):
        return {colour: await chat_tokens(engine, front_end, request) for colour, request in requests.items()}

    results = run(engine, both)
    assert engine.info.vision_architecture in FAMILIES
    for request, tokens in results.values():
        [image] = request.images
        assert image.num_tokens == 20 and image.positions[0] < 16 and image.positions[-1] > 22  # cut by a chunk
        assert tokens == reference(request)
    assert results[RED][1] != results[BLUE][1]  # the image decides the answer


def test_logprobs_match_transformers(qwen):
    engine, reference, _ = qwen
    request = chat_request([GREEN, "what is in this image"])

    async def one(engine, front_end):
        _, [engine_request] = await front_end.chat(request, stream=False)
        return engine_request, await engine.generate(engine_request)

    engine_request, result = run(engine, one)
    tokens, logprobs = reference(engine_request, with_logprobs=True)
    assert [token.id for token in result.tokens] == tokens
    assert max(abs(token.logprob - expected) for token, expected in zip(result.tokens, logprobs, strict=True)) < 1e-4


def test_two_images_text_only_and_staggered_arrivals_match_transformers(qwen):
    """Two images of other sizes in one request; a request with one image and a text-only one (1-D
    positions in a step that carries 3-D ones) arrive while it decodes."""
    engine, reference, _ = qwen
    two = chat_request(["compare", (RED, (56, 24)), "with", (BLUE, (24, 40)), "please"], max_tokens=20)
    one = chat_request([GREEN, "describe the picture"])
    text = chat_request(["describe a picture of a cat"])

    async def staggered(engine, front_end):
        _, [first] = await front_end.chat(two, stream=False)
        _, [second] = await front_end.chat(one, stream=False)
        _, [third] = await front_end.chat(text, stream=False)
        first_tokens = []
        async for output in engine.generate_stream(first):
            first_tokens += [token.id for token in output.tokens]
            if len(first_tokens) == 3:  # the others arrive while the first decodes
                later = asyncio.gather(engine.generate(second), engine.generate(third))
        results = await later
        later_tokens = [[token.id for token in result.tokens] for result in results]
        return [(first, first_tokens), (second, later_tokens[0]), (third, later_tokens[1])]

    results = run(engine, staggered)
    first = results[0][0]
    assert len(first.images) == 2 and first.images[0].num_tokens != first.images[1].num_tokens
    assert not results[2][0].images
    for request, tokens in results:
        assert tokens == reference(request)


@QWEN2_VL_ONLY
def test_a_follow_up_turn_reuses_the_image_blocks(qwen):
    llm_engine, reference, _ = qwen
    turn = [(90, 40, 160), "what is in this image"]
    follow = chat_request(turn, "a red thing", ["and what colour is it"])

    async def turns(engine, front_end):
        first = await chat_tokens(engine, front_end, chat_request(turn))
        hits_before, encoded = engine.stats().num_prefix_hit_tokens, llm_engine.vision.num_encoded_images
        second = await chat_tokens(engine, front_end, follow)
        assert llm_engine.vision.num_encoded_images == encoded  # the cached image is not encoded again
        return first, second, engine.stats().num_prefix_hit_tokens - hits_before

    first, second, hits = run(llm_engine, turns)
    assert hits >= first[0].images[0].positions[-1] + 1  # the image's blocks were reused
    assert second[1] == reference(second[0])


@QWEN2_VL_ONLY
def test_preempted_image_requests_match_transformers(qwen):
    """A pool too small for all of them: preempted requests are recomputed at the same positions."""
    _, reference, folder = qwen
    engine = build_engine(llava_config(folder, num_tokens=160, prefill=64, max_total=100))
    assert_preempted_crowd_matches(engine, reference)


@QWEN2_VL_ONLY
def test_speculation_with_images_matches_transformers(qwen):
    """n-gram guesses verified on image prompts run at the prompt's delta past its end."""
    _, reference, folder = qwen
    config = llava_config(folder)
    engine = build_engine(dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, speculate=3)))

    async def both(engine, front_end):
        return [await chat_tokens(engine, front_end, chat_request([c, "describe"], max_tokens=24)) for c in (RED, BLUE)]

    for request, tokens in run(engine, both):
        assert tokens == reference(request)
    assert engine.num_accepted_tokens > 0


@QWEN2_VL_ONLY
def test_prompt_positions_equal_transformers_rope_index(qwen):
    """The engine's 3-D positions and delta equal `get_rope_index`'s on a two-image prompt."""
    engine, _, folder = qwen
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder)
    request = chat_request(["a", (RED, (56, 24)), "b c", (BLUE, (40, 40))])

    async def prepare(engine, front_end):
        _, [engine_request] = await front_end.chat(request, stream=False)
        return engine_request

    engine_request = run(engine, prepare)
    ids = torch.tensor([engine_request.prompt_token_ids])
    expected, delta = model.model.get_rope_index(
        ids,
        (ids == model.config.image_token_id).int(),
        image_grid_thw=torch.cat([image.extras["image_grid_thw"] for image in engine_request.images]),
    )
    positions = prompt_positions(ids.shape[1], engine_request.images)
    assert torch.equal(positions.table, expected[:, 0])
    assert positions.delta == int(delta) != 0
    after = positions.of(ids.shape[1] - 2, 4)  # two prompt tokens, then two generated ones
    assert after[:, 2:].tolist() == [[ids.shape[1] + delta, ids.shape[1] + 1 + delta]] * 3


@QWEN2_VL_ONLY
def test_tgi_markdown_images_sit_between_the_vision_markers(qwen):
    engine, reference, _ = qwen
    image = f"![]({data_uri(image_bytes(RED))})"
    inputs = f"<|im_start|>user\n{image}what is in this image<|im_end|>\n<|im_start|>assistant\n"
    request = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(max_new_tokens=8))

    async def tgi(engine, front_end):
        validated = await front_end.generate(request, stream=False)
        result = await engine.generate(validated.engine_request)
        return validated.engine_request, [token.id for token in result.tokens]

    engine_request, tokens = run(engine, tgi)
    [image_input] = engine_request.images
    ids, tokenizer = engine_request.prompt_token_ids, engine.tokenizer
    first, last = image_input.positions[0], image_input.positions[-1]
    assert ids[first - 1] == tokenizer.convert_tokens_to_ids(VISION_START)
    assert ids[last + 1] == tokenizer.convert_tokens_to_ids(VISION_END)
    assert tokens == reference(engine_request)
