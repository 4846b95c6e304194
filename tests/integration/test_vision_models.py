"""Vision-language models on the paged path: greedy output token-identical to transformers'
`generate` on the same processor outputs, with one and two images, staggered arrivals, chunked
prefill cutting through an image, preemption, and prefix reuse of an image in a second turn."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from google.protobuf import json_format

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.builder import build_engine
from inference_service.errors import ModelLoadError, ValidationError
from inference_service.frontend.front_end import FrontEnd
from tests.image_server import data_uri, image_bytes
from tests.tiny_vision import save_llava, save_llava_next
from tests.vision_reference import greedy_reference
from textgen.v1 import generate_pb2 as pb

RED, BLUE, GREEN = (220, 20, 20), (20, 20, 220), (20, 200, 20)
MAX_NEW = 12


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return save_llava(tmp_path_factory.mktemp("tiny-llava"))


def llava_config(folder, *, num_tokens: int = 2048, prefill: int = 20, max_total: int = 256) -> EngineConfig:
    """Blocks of 4 and 20-token steps: the 16 tokens of an image (prompt positions 7..22) are cut
    by the chunk boundary at 20."""
    return EngineConfig(
        model=ModelConfig(model_id=str(folder), device="cpu", dtype="float32"),
        cache=CacheConfig(max_batch_total_tokens=num_tokens, block_size=4),
        scheduler=SchedulerConfig(max_batch_prefill_tokens=prefill),
        limits=LimitsConfig(max_total_tokens=max_total, max_images_per_request=3),
    )


@pytest.fixture(scope="module")
def llava_engine(llava_dir):
    return build_engine(llava_config(llava_dir))


@pytest.fixture(scope="module")
def reference(llava_dir):
    return transformers_reference(llava_dir)


def transformers_reference(folder):
    """Greedy tokens (and each one's raw logprob) of transformers on the processor outputs the engine ran."""

    def inputs(model, request, ids):
        extras = {key: torch.cat([image.extras[key] for image in request.images]) for key in request.images[0].extras}
        return {"pixel_values": torch.cat([image.pixel_values for image in request.images]), **extras}

    return greedy_reference(folder, inputs)


def chat_request(*turns: list, max_tokens: int = MAX_NEW, size=(40, 30)) -> pb.ChatCompletionRequest:
    """A chat request of user/assistant turns; a user turn's content is a list of colours and texts
    (a (colour, size) pair for an image of another size)."""
    messages = []
    for index, turn in enumerate(turns):
        if index % 2:
            messages.append({"role": "assistant", "content": turn})
            continue
        parts = [
            {"type": "text", "text": part}
            if isinstance(part, str)
            else {"type": "image_url", "image_url": {"url": data_uri(_image(part, size))}}
            for part in turn
        ]
        messages.append({"role": "user", "content": parts})
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "messages": messages}
    return json_format.ParseDict(body, pb.ChatCompletionRequest())


def _image(part, size) -> bytes:
    colour, size = part if isinstance(part[0], tuple) else (part, size)
    return image_bytes(colour, size)


def run(engine, coroutine_fn):
    async def main():
        async_engine = AsyncEngine(engine, max_concurrent_requests=8)
        async_engine.start()
        try:
            return await coroutine_fn(async_engine, FrontEnd.for_engine(async_engine))
        finally:
            await async_engine.shutdown(timeout_s=1)

    return asyncio.run(main())


async def chat_tokens(engine: AsyncEngine, front_end: FrontEnd, request: pb.ChatCompletionRequest):
    _, [engine_request] = await front_end.chat(request, stream=False)
    result = await engine.generate(engine_request)
    return engine_request, [token.id for token in result.tokens]


def test_one_image_chunked_through_it_matches_transformers(llava_engine, reference):
    requests = {colour: chat_request([colour, "what is in this image"]) for colour in (RED, BLUE)}

    async def both(engine, front_end):
        return {colour: await chat_tokens(engine, front_end, request) for colour, request in requests.items()}

    results = run(llava_engine, both)
    for request, tokens in results.values():
        [image] = request.images
        assert image.num_tokens == 16 and image.positions[0] < 20 < image.positions[-1]  # cut by the chunk
        assert tokens == reference(request)
    assert results[RED][1] != results[BLUE][1]  # the image decides the answer


def test_decode_steps_run_through_the_fused_decode_plan(llava_engine):
    """LLaVA's language model is Llama: its decode-only steps (no image token in them) take the fused
    plan; every other test here checks them token for token against transformers."""
    assert llava_engine.runner.decode_step is not None
    assert len(llava_engine.runner.decode_step.layers) == llava_engine.runner.model.config.text_config.num_hidden_layers


def test_logprobs_match_transformers(llava_engine, reference):
    request = chat_request([RED, "what is in this image"])

    async def one(engine, front_end):
        _, [engine_request] = await front_end.chat(request, stream=False)
        return engine_request, await engine.generate(engine_request)

    engine_request, result = run(llava_engine, one)
    tokens, logprobs = reference(engine_request, with_logprobs=True)
    assert [token.id for token in result.tokens] == tokens
    assert max(abs(token.logprob - expected) for token, expected in zip(result.tokens, logprobs, strict=True)) < 1e-4


def test_speculation_with_images_matches_transformers(llava_dir, reference):
    """n-gram guesses verified on image prompts (the tiny model repeats itself, so guesses land)."""
    config = llava_config(llava_dir)
    engine = build_engine(dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, speculate=3)))

    async def both(engine, front_end):
        return [await chat_tokens(engine, front_end, chat_request([c, "describe"], max_tokens=24)) for c in (RED, BLUE)]

    for request, tokens in run(engine, both):
        assert tokens == reference(request)
    assert engine.num_accepted_tokens > 0


def test_two_images_and_staggered_arrivals_match_transformers(llava_engine, reference):
    two = chat_request(["compare", RED, "with", BLUE, "please"], max_tokens=20)
    one = chat_request([GREEN, "describe the picture"])

    async def staggered(engine, front_end):
        _, [first] = await front_end.chat(two, stream=False)
        _, [second] = await front_end.chat(one, stream=False)
        stream = engine.generate_stream(first)
        first_tokens = []
        async for output in stream:
            first_tokens += [token.id for token in output.tokens]
            if len(first_tokens) == 3:  # the second arrives while the first decodes
                later = asyncio.ensure_future(engine.generate(second))
        second_result = await later
        return (first, first_tokens), (second, [token.id for token in second_result.tokens])

    (first, first_tokens), (second, second_tokens) = run(llava_engine, staggered)
    assert len(first.images) == 2 and first.images[0].content_hash != first.images[1].content_hash
    assert first_tokens == reference(first)
    assert second_tokens == reference(second)


def test_a_follow_up_turn_reuses_the_image_blocks(llava_engine, reference):
    # Colours no other test sends: nothing of these prompts is cached before.
    turn = [(90, 40, 160), "what is in this image"]
    follow = chat_request(turn, "a red thing", ["and what colour is it"])
    other_image = chat_request([(91, 40, 160), "what is in this image"], "a red thing", ["and what colour is it"])

    async def turns(engine, front_end):
        first = await chat_tokens(engine, front_end, chat_request(turn))
        hits_before = engine.stats().num_prefix_hit_tokens
        encoded_before = llava_engine.vision.num_encoded_images
        second = await chat_tokens(engine, front_end, follow)
        hits_same = engine.stats().num_prefix_hit_tokens - hits_before
        encoded = [llava_engine.vision.num_encoded_images - encoded_before]
        third = await chat_tokens(engine, front_end, other_image)
        hits_other = engine.stats().num_prefix_hit_tokens - hits_before - hits_same
        encoded.append(llava_engine.vision.num_encoded_images - encoded_before - encoded[0])
        return first, second, third, hits_same, hits_other, encoded

    first, second, third, hits_same, hits_other, encoded = run(llava_engine, turns)
    image_end = first[0].images[0].positions[-1] + 1
    assert hits_same >= image_end  # the image's blocks were reused, not recomputed
    assert encoded == [0, 1]  # ...nor the image encoded again; another image is
    assert hits_other < first[0].images[0].positions[0] + 4  # another image at the same place: no reuse past it
    assert second[1] == reference(second[0])
    assert third[1] == reference(third[0])


def assert_preempted_crowd_matches(engine, reference) -> None:
    """Four image requests at once on `engine` (a pool too small for them all): some are preempted
    and recomputed, each still equals transformers, and every KV block is free afterwards."""
    colours = [RED, BLUE, GREEN, (200, 200, 20)]

    async def crowd(engine, front_end):
        return await asyncio.gather(
            *(chat_tokens(engine, front_end, chat_request([c, "describe"], max_tokens=30)) for c in colours)
        )

    results = run(engine, crowd)
    assert engine.scheduler.num_preemptions > 0
    for request, tokens in results:
        assert tokens == reference(request)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_preempted_image_requests_match_transformers(llava_dir, reference):
    """A pool too small for all of them: requests are preempted and recomputed (the encoder's rows kept)."""
    engine = build_engine(llava_config(llava_dir, num_tokens=160, prefill=64, max_total=100))
    assert_preempted_crowd_matches(engine, reference)


def test_tgi_markdown_images_match_the_chat_route(llava_engine, reference):
    inputs = f"USER: ![]({data_uri(image_bytes(RED))})\nwhat is in this image ASSISTANT:"
    request = pb.GenerateRequest(inputs=inputs, parameters=pb.GenerateParameters(max_new_tokens=MAX_NEW))

    async def tgi(engine, front_end):
        validated = await front_end.generate(request, stream=False)
        result = await engine.generate(validated.engine_request)
        return validated.engine_request, [token.id for token in result.tokens]

    engine_request, tokens = run(llava_engine, tgi)
    assert len(engine_request.images) == 1
    assert tokens == reference(engine_request)


def test_typed_image_bytes_equal_a_data_uri(llava_engine):
    uri_request = chat_request([RED, "what is in this image"])
    typed = pb.ChatCompletionRequest(model="m", max_tokens=MAX_NEW, temperature=0)
    message = typed.messages.add(role="user")
    message.content.list_value.values.add().struct_value.update({"type": "text", "text": "what is in this image"})
    message.images.add(data=image_bytes(RED))

    async def both(engine, front_end):
        return [await chat_tokens(engine, front_end, r) for r in (uri_request, typed)]

    (by_uri, uri_tokens), (by_bytes, byte_tokens) = run(llava_engine, both)
    assert by_bytes.prompt_token_ids == by_uri.prompt_token_ids
    assert byte_tokens == uri_tokens


def test_bad_image_inputs_are_validation_errors(llava_engine):
    too_many = chat_request([RED, BLUE, GREEN, RED, "four"])
    too_long = chat_request([RED, "describe " * 240])  # its image's 16 tokens push it past the limit
    not_an_image = json_format.ParseDict(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
            ],
        },
        pb.ChatCompletionRequest(),
    )

    async def bad(engine, front_end):
        errors = []
        for request in (too_many, not_an_image, too_long):
            with pytest.raises(ValidationError) as caught:
                await front_end.chat(request, stream=False)
            errors.append(str(caught.value))
        # the engine still serves the next request
        _, tokens = await chat_tokens(engine, front_end, chat_request([RED, "hi"], max_tokens=2))
        return errors, tokens

    errors, tokens = run(llava_engine, bad)
    assert "at most 3 images" in errors[0]
    assert "not an image" in errors[1]
    assert "`inputs` tokens + `max_new_tokens` must be <= 256" in errors[2]
    assert len(tokens) == 2


def test_llava_next_images_of_two_sizes_staggered_match_transformers(tmp_path_factory):
    """LLaVA-NeXT: any-resolution tiles, so images of other shapes give other token counts (and are
    encoded in separate batches); one request holds a wide and a tall image, another arrives later."""
    folder = save_llava_next(tmp_path_factory.mktemp("tiny-llava-next"))
    engine = build_engine(llava_config(folder))
    reference = transformers_reference(folder)
    two = chat_request(["compare", (RED, (70, 30)), "with", (BLUE, (30, 70))], max_tokens=16)
    one = chat_request([(GREEN, (40, 40)), "describe the picture"])

    async def staggered(engine, front_end):
        _, [first] = await front_end.chat(two, stream=False)
        _, [second] = await front_end.chat(one, stream=False)
        stream = engine.generate_stream(first)
        first_tokens = []
        async for output in stream:
            first_tokens += [token.id for token in output.tokens]
            if len(first_tokens) == 2:
                later = asyncio.ensure_future(engine.generate(second))
        second_result = await later
        return (first, first_tokens), (second, [token.id for token in second_result.tokens])

    (first, first_tokens), (second, second_tokens) = run(engine, staggered)
    assert engine.info.vision_architecture == "llava_next"
    assert len({image.num_tokens for image in (*first.images, *second.images)}) > 1  # sizes differ
    assert first_tokens == reference(first)
    assert second_tokens == reference(second)


@pytest.mark.parametrize("model_type", ["idefics2", "llava_onevision"])
def test_unsupported_vision_architectures_are_refused_by_name(tmp_path, model_type):
    """Refused from the config alone, before any weight is read (the folder holds none)."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=f"vision-language architecture '{model_type}' is not supported: "):
        build_engine(EngineConfig(model=ModelConfig(model_id=str(tmp_path), device="cpu")))


def test_a_follow_up_reuses_the_whole_first_turn_its_reply_and_partial_block_included(llava_engine, reference):
    """A reply that tokenizes back to the ids generated (here: the model biased to one word, put back
    without its leading space, as LLaVA's template writes it): the second turn reuses every token the
    first computed, through its partial last block, computes only the new question, and still
    answers as transformers does; every block is free once both are done."""
    [word] = llava_engine.tokenizer.encode(" the", add_special_tokens=False)
    first_request = chat_request([(93, 40, 160), "what is in this image"])
    first_request.logit_bias[str(word)] = 100

    async def turns(engine, front_end):
        first = await chat_tokens(engine, front_end, first_request)
        reply = llava_engine.tokenizer.decode(first[1]).lstrip()
        hits_before, adopted_before = engine.stats().num_prefix_hit_tokens, llava_engine.prefix_cache.num_adopted_blocks
        encoded_before = llava_engine.vision.num_encoded_images
        follow = chat_request([(93, 40, 160), "what is in this image"], reply, ["and what colour is it"])
        second = await chat_tokens(engine, front_end, follow)
        return (
            first,
            second,
            engine.stats().num_prefix_hit_tokens - hits_before,
            llava_engine.prefix_cache.num_adopted_blocks - adopted_before,
            llava_engine.vision.num_encoded_images - encoded_before,
        )

    first, second, hits, adopted, encoded = run(llava_engine, turns)
    first_ids = first[0].prompt_token_ids + first[1]
    assert second[0].prompt_token_ids[: len(first_ids)] == first_ids  # the reply tokenized back to its ids
    assert hits == len(first_ids) - 1  # all the first turn computed: its last sampled token never ran
    assert len(first_ids) % 4 != 1 and adopted == 1  # ...the last 1..3 of them from its partial block
    assert encoded == 0
    assert second[1] == reference(second[0])
    assert llava_engine.kv.num_free_blocks == llava_engine.kv.num_blocks and llava_engine.kv.holders() == []
