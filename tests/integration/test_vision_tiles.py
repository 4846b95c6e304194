"""Idefics3 on the paged path: an image is split into tiles plus a global image, each tile's tokens
after its own text tag, so one image's rows lie in several runs with text between them. Greedy output
token-identical to transformers' `generate` on the same processor outputs (logprobs within 1e-4),
with two images of different tile counts, staggered arrivals, 20-token chunks cutting through tiles,
and a second turn reusing the first's image blocks."""

from __future__ import annotations

import pytest
import torch

from inference_service.engine.builder import build_engine
from tests.integration.test_vision_both_ways import assert_matches, staggered_pair
from tests.integration.test_vision_models import (
    BLUE,
    GREEN,
    RED,
    chat_request,
    chat_tokens,
    llava_config,
    run,
)
from tests.tiny_vision_idefics import save_idefics3


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    return save_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


def tiles_reference(folder):
    """transformers' greedy generate with the images' tiles side by side in one batch entry, as the
    processor gives them ([1, tiles of all images, 3, H, W])."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager").eval()

    def generate(request, with_logprobs: bool = False):
        ids = torch.tensor([request.prompt_token_ids])
        pixels = torch.cat([image.pixel_values for image in request.images], dim=1)
        masks = torch.cat([image.extras["pixel_attention_mask"] for image in request.images], dim=1)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                pixel_values=pixels,
                pixel_attention_mask=masks,
                max_new_tokens=request.stopping.max_new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, ids.shape[1] :].tolist()
        if not with_logprobs:
            return tokens
        steps = zip(out.logits, tokens, strict=True)
        return tokens, [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in steps]

    return generate


@pytest.fixture(scope="module")
def idefics3_engine(idefics3_dir):
    return build_engine(llava_config(idefics3_dir, max_total=400))


def test_tiled_images_staggered_and_chunked_match_transformers(idefics3_engine, idefics3_dir):
    reference = tiles_reference(idefics3_dir)
    two = chat_request(["compare", (RED, (70, 30)), "with", (BLUE, (30, 30))], max_tokens=16)
    one = chat_request([(GREEN, (40, 40)), "describe the picture"])
    (first, first_tokens), (second, second_tokens) = staggered_pair(idefics3_engine, two, one)
    assert idefics3_engine.info.vision_architecture == "idefics3"
    wide, square = first.images
    assert wide.num_tokens == 3 * 4 and square.num_tokens == 5 * 4  # 2 tiles + global, 4 tiles + global
    assert wide.pixel_values.shape[1] == 3 and square.pixel_values.shape[1] == 5
    assert wide.positions[-1] - wide.positions[0] + 1 > wide.num_tokens  # text tags between its tiles
    assert_matches(reference, first, first_tokens)
    assert_matches(reference, second, second_tokens)


def test_a_follow_up_turn_reuses_the_tiles(idefics3_engine, idefics3_dir):
    reference = tiles_reference(idefics3_dir)
    turn = [((90, 40, 160), (70, 30)), "what is in this image"]

    async def turns(engine, front_end):
        first = await chat_tokens(engine, front_end, chat_request(turn))
        before = engine.stats().num_prefix_hit_tokens
        second = await chat_tokens(engine, front_end, chat_request(turn, "a thing", ["and its colour"]))
        return first, second, engine.stats().num_prefix_hit_tokens - before

    first, second, hits = run(idefics3_engine, turns)
    assert hits >= first[0].images[0].positions[-1] + 1
    for request, tokens in (first, second):
        assert tokens == reference(request)
