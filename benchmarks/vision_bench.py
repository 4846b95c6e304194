"""Vision-language serving: continuous batching of image+text requests against transformers' static
batches, and a follow-up turn with the same image against the first turn (prefix caching).

Model: a small random LLaVA-1.5 built here (CLIP vision tower, Llama text model, its processor; no
download), 128x128 images in 8x8 patches, so 256 image tokens per image. Both parts run in one process
on the same weights; ratios are taken within the run (this CPU is shared and noisy).

- Batching: 16 requests, each a different image and a short question, greedy, EOS ignored, 32 new
  tokens each, all submitted at once to the engine; transformers runs the same processor outputs as
  one padded `generate` batch of 16 (left padding; its vision tower once per image, like ours).
  Reported: generated tokens per second of each, and their ratio (goal ≥ 2.5×).
  The engine runs the batch under both prefill-pool rules of engine/step_cost.py: `share per
  prompt` (each long prompt still prefilling beside streams gets its own share of the step budget,
  the default) and `one share` (all of them share one, as before), so the fix is a same-run ratio.
  Rounds alternate the order of the three runs, each round with fresh images (no prefix-cache hits
  across runs); medians of the rounds are reported, with each round's engine ÷ transformers.
- Follow-up turn: a conversation's first turn (image + question), then a second turn whose history
  holds the same image and the first reply. Reported: time to first token of each (the second
  reuses the image's KV blocks and skips the vision encoder's work for its cached tokens; goal ≥ 3×).

`--family gemma3|paligemma|idefics3|smolvlm|mllama` runs the same on that family's tiny random model
(64 wide, 2 or 3 layers, 32x32 images: 4, 16 and 20 image tokens; tests/tiny_vision_gemma.py,
tests/tiny_vision_idefics.py, tests/tiny_vision_mllama.py): image tokens that attend both ways
(prefilled whole, one chunk each), tiles between text tags, or (Mllama) one image token whose image
the language model reads through cross-attention, on the fallback path (transformers' attention,
no prefix caching: its follow-up turn recomputes the image).

Usage: python benchmarks/vision_bench.py [--quick] [--rounds N] [--family NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protos"))

import torch  # noqa: E402
from google.protobuf import json_format  # noqa: E402
from PIL import Image  # noqa: E402

from benchmarks import common  # noqa: E402
from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig  # noqa: E402
from inference_service.engine.async_engine import AsyncEngine  # noqa: E402
from inference_service.engine.builder import build_engine  # noqa: E402
from inference_service.engine.step_cost import StepCost  # noqa: E402
from inference_service.frontend.front_end import FrontEnd  # noqa: E402
from tests.tiny_vision import save_llava  # noqa: E402
from tests.tiny_vision_gemma import save_gemma3, save_paligemma  # noqa: E402
from tests.tiny_vision_idefics import save_idefics3  # noqa: E402
from tests.tiny_vision_mllama import save_mllama  # noqa: E402
from textgen.v1 import generate_pb2 as pb  # noqa: E402

FAMILIES = {
    "gemma3": save_gemma3,
    "paligemma": save_paligemma,
    "idefics3": save_idefics3,
    "smolvlm": lambda folder: save_idefics3(folder, family="smolvlm"),
    "mllama": save_mllama,
}
FULL = {"requests": 16, "new_tokens": 32, "hidden": 384, "layers": 6, "image": 128}
QUICK = {"requests": 4, "new_tokens": 4, "hidden": 64, "layers": 2, "image": 32}


def image_uri(index: int, size: int) -> str:
    colour = ((37 * index) % 256, (91 * index + 50) % 256, (53 * index + 120) % 256)
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(messages: list[dict], max_tokens: int) -> pb.ChatCompletionRequest:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    return json_format.ParseDict(body, pb.ChatCompletionRequest())


def user_turn(index: int, size: int, text: str) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": image_uri(index, size)}},
            {"type": "text", "text": text},
        ],
    }


class OneShareCost(StepCost):
    """The rule before: all prompts still prefilling beside streams share one share of the budget."""

    def stream_pool(self, budget: int, decode_work: float, num_prompts: int = 1) -> float:
        return super().stream_pool(budget, decode_work, 1)


async def engine_batch(
    engine: AsyncEngine, front_end: FrontEnd, params: dict, first_image: int = 0
) -> tuple[float, list]:
    requests = []
    for index in range(first_image, first_image + params["requests"]):
        _, [request] = await front_end.chat(
            chat([user_turn(index, params["image"], f"what is in picture {index}")], params["new_tokens"]),
            stream=False,
        )
        stopping = request.stopping.__class__(max_new_tokens=params["new_tokens"], ignore_eos=True)
        requests.append(request.__class__(**{**request.__dict__, "stopping": stopping}))
    started = time.perf_counter()
    await asyncio.gather(*(engine.generate(request) for request in requests))
    return time.perf_counter() - started, requests


def family_inputs(model, requests, width: int) -> dict:
    """What the family's `generate` reads beside the ids: Gemma 3's image token types, PaliGemma's
    prefix (types 0), Idefics3's (and SmolVLM's) pixel mask, Mllama's aspect ratios and its
    cross-attention mask (left-padded with the ids)."""
    model_type = model.config.model_type
    if model_type in ("gemma3", "paligemma"):
        types = torch.zeros(len(requests), width, dtype=torch.long)
        if model_type == "gemma3":
            for row, request in enumerate(requests):
                pad = width - len(request.prompt_token_ids)
                for image in request.images:
                    types[row, [pad + p for p in image.positions]] = 1
        return {"token_type_ids": types}
    if model_type == "mllama":
        images = [r.images[0] for r in requests]
        masks = [
            torch.nn.functional.pad(i.extras["cross_attention_mask"], (0, 0, 0, 0, width - len(r.prompt_token_ids), 0))
            for r, i in zip(requests, images, strict=True)
        ]
        return {
            "aspect_ratio_ids": torch.cat([i.extras["aspect_ratio_ids"] for i in images]),
            "aspect_ratio_mask": torch.cat([i.extras["aspect_ratio_mask"] for i in images]),
            "cross_attention_mask": torch.cat(masks),
        }
    if model_type in ("idefics3", "smolvlm"):
        return {
            "pixel_attention_mask": torch.cat([i.extras["pixel_attention_mask"] for r in requests for i in r.images])
        }
    return {}


def transformers_batch(model, requests, pad_id: int, new_tokens: int) -> float:
    width = max(len(r.prompt_token_ids) for r in requests)
    ids = torch.tensor([[pad_id] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in requests])
    mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in requests])
    pixels = torch.cat([image.pixel_values for r in requests for image in r.images])
    extras = family_inputs(model, requests, width)
    started = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            pixel_values=pixels,
            **extras,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    return time.perf_counter() - started


async def first_token_seconds(engine: AsyncEngine, front_end: FrontEnd, request: pb.ChatCompletionRequest):
    _, [engine_request] = await front_end.chat(request, stream=False)
    started = time.perf_counter()
    stream = engine.generate_stream(engine_request)
    ttft = None
    text = []
    async for output in stream:
        if ttft is None and output.tokens:
            ttft = time.perf_counter() - started
        text += [token.text for token in output.tokens]
    return ttft, "".join(text)


async def follow_up(engine: AsyncEngine, front_end: FrontEnd, params: dict) -> tuple[float, float]:
    first_turn = [user_turn(999, params["image"], "describe this picture in detail")]
    first_ttft, reply = await first_token_seconds(engine, front_end, chat(first_turn, 8))
    second_turn = [*first_turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "and its colour?"}]
    second_ttft, _ = await first_token_seconds(engine, front_end, chat(second_turn, 8))
    return first_ttft, second_ttft


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the three runs (default 3; --quick 1)")
    parser.add_argument("--family", choices=["llava", *FAMILIES], default="llava")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    params = QUICK if args.quick else FULL
    if args.family != "llava":  # the family's tiny model and its 32x32 images
        params = {**params, "hidden": 64, "layers": 2, "image": 32}
    rounds = args.rounds or (1 if args.quick else 3)
    out = common.output_dir(args.out, args.quick)
    runs = ("share per prompt", "one share", "transformers")
    seconds: dict[str, list[float]] = {run: [] for run in runs}
    steps: dict[str, list[int]] = {run: [] for run in runs[:2]}
    with tempfile.TemporaryDirectory() as scratch:
        if args.family == "llava":
            folder = save_llava(
                Path(scratch), hidden_size=params["hidden"], num_layers=params["layers"], image_size=params["image"]
            )
        else:
            folder = FAMILIES[args.family](Path(scratch))
        config = EngineConfig(
            model=ModelConfig(model_id=str(folder), device="cpu", dtype="float32"),
            cache=CacheConfig(max_batch_total_tokens=16384),
            limits=LimitsConfig(max_total_tokens=1024),
        )
        engine = build_engine(config)
        attention = engine.info.attention_impl  # "paged", or "transformers" (Mllama's fallback path)
        costs = {"share per prompt": engine.scheduler.cost, "one share": OneShareCost(**vars(engine.scheduler.cost))}
        pad_id = engine.tokenizer.pad_token_id
        from transformers import AutoModelForImageTextToText

        reference = AutoModelForImageTextToText.from_pretrained(folder).eval()

        async def serve():
            async_engine = AsyncEngine(engine, max_concurrent_requests=64)
            async_engine.start()
            try:
                front_end = FrontEnd.for_engine(async_engine)
                _, warm = await engine_batch(async_engine, front_end, {**params, "requests": 2}, 10_000)
                transformers_batch(reference, warm, pad_id, 2)
                for round_index in range(rounds):
                    order = runs if round_index % 2 == 0 else runs[::-1]
                    for number, run in enumerate(order):
                        first_image = 1000 * (round_index + 1) + 100 * number  # fresh images: no cache hits
                        if run == "transformers":
                            _, requests = await engine_batch(
                                async_engine, front_end, {**params, "new_tokens": 1}, first_image
                            )
                            seconds[run].append(transformers_batch(reference, requests, pad_id, params["new_tokens"]))
                            continue
                        engine.scheduler.cost = costs[run]  # between batches: the engine thread is idle
                        steps_before = engine.num_steps
                        elapsed, _ = await engine_batch(async_engine, front_end, params, first_image)
                        seconds[run].append(elapsed)
                        steps[run].append(engine.num_steps - steps_before)
                engine.scheduler.cost = costs["share per prompt"]
                return await follow_up(async_engine, front_end, params)
            finally:
                await async_engine.shutdown(timeout_s=1)

        first_ttft, second_ttft = asyncio.run(serve())
    generated = params["requests"] * params["new_tokens"]
    med = {run: statistics.median(values) for run, values in seconds.items()}
    rows = [
        [f"engine, {run} (continuous batching, {attention})", common.fmt(generated / med[run]), common.fmt(med[run], 2)]
        + [str(statistics.median(steps[run]))]
        for run in runs[:2]
    ]
    rows.append(
        [
            "transformers (one static batch)",
            common.fmt(generated / med["transformers"]),
            common.fmt(med["transformers"], 2),
            "-",
        ]
    )
    table = common.markdown_table(["image+text requests", "tokens/s", "seconds", "engine steps"], rows)
    per_round = ", ".join(
        f"{hf / ours:.2f}×" for hf, ours in zip(seconds["transformers"], seconds["share per prompt"], strict=True)
    )
    ours = med["share per prompt"]
    summary = (
        f"Model: a random {args.family}.\n\n{table}\n\n"
        f"Throughput ratio, engine ÷ transformers: {common.ratio(med['transformers'], ours)} "
        f"(rounds: {per_round}; {params['requests']} requests, {params['new_tokens']} new tokens each, "
        "one image each).\n"
        f"Prefill pool, share per prompt ÷ one share: {common.ratio(med['one share'], ours)} "
        f"the tokens/s (medians of {rounds} round(s), the three runs in every round).\n"
        f"Follow-up turn with the same image: TTFT {first_ttft * 1000:.0f} ms → {second_ttft * 1000:.0f} ms "
        f"({common.ratio(first_ttft, second_ttft)} faster).\n\n{common.machine_line(common.machine())}\n"
    )
    print(summary)
    name = "vision" if args.family == "llava" else f"vision_{args.family}"
    (out / f"{name}.md").write_text(summary)
    common.write_json(
        out / f"{name}.json",
        {
            "family": args.family,
            "params": params,
            "rounds": rounds,
            "seconds": seconds,
            "engine_steps": steps,
            "engine_seconds": med["share per prompt"],
            "transformers_seconds": med["transformers"],
            "first_turn_ttft_s": first_ttft,
            "follow_up_ttft_s": second_ttft,
        },
    )


if __name__ == "__main__":
    main()
