"""Idefics3 on the paged path: an image is split into tiles plus a global image, each tile's tokens
after its own text tag, so one image's rows lie in several runs with text between them. Greedy output
token-identical to transformers' `generate` on the same processor outputs (logprobs within 1e-4),
with two images of different tile counts, staggered arrivals, 20-token chunks cutting through tiles,
and a second turn reusing the first's image blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inference_service.config import CacheConfig
from inference_service.engine.builder import build_engine
from inference_service.errors import ValidationError
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
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
from tests.vision_reference import greedy_reference


@pytest.fixture(scope="module")
def idefics3_dir(tmp_path_factory):
    return save_idefics3(tmp_path_factory.mktemp("tiny-idefics3"))


def tiles_reference(folder):
    """transformers' greedy generate with the images' tiles side by side in one batch entry, as the
    processor gives them ([1, tiles of all images, 3, H, W])."""

    def inputs(model, request, ids):
        masks = [image.extras["pixel_attention_mask"] for image in request.images]
        pixels = [image.pixel_values for image in request.images]
        return {"pixel_values": torch.cat(pixels, dim=1), "pixel_attention_mask": torch.cat(masks, dim=1)}

    return greedy_reference(folder, inputs)


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
        before, encoded = engine.stats().num_prefix_hit_tokens, idefics3_engine.vision.num_encoded_images
        second = await chat_tokens(engine, front_end, chat_request(turn, "a thing", ["and its colour"]))
        assert idefics3_engine.vision.num_encoded_images == encoded  # the cached tiles are not encoded again
        return first, second, engine.stats().num_prefix_hit_tokens - before

    first, second, hits = run(idefics3_engine, turns)
    assert hits >= first[0].images[0].positions[-1] + 1
    for request, tokens in (first, second):
        assert tokens == reference(request)


def test_the_encoder_memory_is_kept_and_images_past_it_are_refused(idefics3_dir):
    """The reservation holds --max-images-per-request images of the processor's most tiles (4 + the
    global image here), out of the KV budget; a request needing more is a typed validation error."""
    config = llava_config(idefics3_dir, max_total=400)
    sized = dataclasses.replace(config, cache=CacheConfig(kv_cache_memory="1MiB", block_size=4))
    engine = build_engine(sized)
    info = engine.info
    assert info.encoder_memory_bytes == 3 * 5 * info.encoder_crop_bytes > 0
    shapes = [LayerShape(num_kv_heads=2, head_dim=16)] * 2  # the tiny Llama text model's
    bytes_per_block = PagedKVCache.bytes_per_token(shapes, torch.float32) * 4
    assert info.num_blocks == (2**20 - info.encoder_memory_bytes) // bytes_per_block
    engine.info = dataclasses.replace(info, encoder_memory_bytes=4 * info.encoder_crop_bytes)  # 4 crops kept

    async def both(engine, front_end):
        with pytest.raises(ValidationError, match=r"\(5 crops\); this server keeps"):
            await front_end.chat(chat_request([(RED, (30, 30)), "describe"]), stream=False)
        return await chat_tokens(engine, front_end, chat_request([(RED, (70, 30)), "describe"], max_tokens=2))

    _, tokens = run(engine, both)  # 3 crops fit, and the engine still serves
    assert len(tokens) == 2
