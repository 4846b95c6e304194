"""SmolVLM on the paged path: Idefics3's tiles plus global image, through SmolVLM's own processor
built without its video processor (no torchvision). Greedy output token-identical to transformers'
`generate` on the same processor outputs (logprobs within 1e-4), with one and two images, staggered
arrivals, 20-token chunks cutting through tiles, and a second turn reusing the first's image."""

from __future__ import annotations

import pytest

from inference_service.engine.builder import build_engine
from tests.integration.test_vision_both_ways import assert_matches, staggered_pair
from tests.integration.test_vision_models import BLUE, GREEN, RED, chat_request, chat_tokens, llava_config, run
from tests.integration.test_vision_tiles import tiles_reference
from tests.tiny_vision_idefics import save_idefics3


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    return save_idefics3(tmp_path_factory.mktemp("tiny-smolvlm"), family="smolvlm")


@pytest.fixture(scope="module")
def smolvlm_engine(smolvlm_dir):
    return build_engine(llava_config(smolvlm_dir, max_total=400))


def test_smolvlm_images_staggered_and_chunked_match_transformers(smolvlm_engine, smolvlm_dir):
    reference = tiles_reference(smolvlm_dir)
    two = chat_request(["compare", (RED, (70, 30)), "with", (BLUE, (30, 30))], max_tokens=16)
    one = chat_request([(GREEN, (40, 40)), "describe the picture"])
    (first, first_tokens), (second, second_tokens) = staggered_pair(smolvlm_engine, two, one)
    assert smolvlm_engine.info.vision_architecture == "smolvlm"
    assert type(smolvlm_engine.processor).__name__ == "SmolVLMImagesOnlyProcessor"
    wide, square = first.images
    assert wide.num_tokens == 3 * 4 and square.num_tokens == 5 * 4  # 2 tiles + global, 4 tiles + global
    assert len(second.images) == 1
    assert_matches(reference, first, first_tokens)
    assert_matches(reference, second, second_tokens)


def test_smolvlm_follow_up_turn_reuses_the_tiles(smolvlm_engine, smolvlm_dir):
    reference = tiles_reference(smolvlm_dir)
    turn = [((90, 40, 160), (70, 30)), "what is in this image"]

    async def turns(engine, front_end):
        first = await chat_tokens(engine, front_end, chat_request(turn))
        before = engine.stats().num_prefix_hit_tokens
        second = await chat_tokens(engine, front_end, chat_request(turn, "a thing", ["and its colour"]))
        return first, second, engine.stats().num_prefix_hit_tokens - before

    first, second, hits = run(smolvlm_engine, turns)
    assert hits >= first[0].images[0].positions[-1] + 1
    for request, tokens in (first, second):
        assert tokens == reference(request)
