"""Vision-language serving: 16 concurrent image+text requests through the engine's continuous batching
against transformers' static batches of the same, and a follow-up turn with the same image against
the first turn (prefix caching).

Model: a small random LLaVA-1.5 built here (CLIP vision tower, Llama text model, its processor; no
download), 128x128 images in 8x8 patches, so 256 image tokens per image (~290-token prompts). Both
sides run in one process on the same weights, in fp32, with the same threads, greedy, on the same
processor outputs (the front end's work is done before the clock starts, for both); ratios are taken
within the run (a shared CPU is noisy), each round alternating which side runs first, with fresh
images in every run (no prefix-cache hits across runs); medians of the rounds are reported.

Three workloads, each 16 requests of one image and a short question:

- **chat** (the goal's row): what a vision chat server sees. Answers of different lengths: each request
  has its own fixed length, drawn (seeded) from 64..256 new tokens, standing in for answers that end at
  EOS at different points (a random model's EOS is meaningless, so EOS is ignored and the length is
  the request's `max_new_tokens`). Requests arrive staggered: a Poisson process, mean gap 0.1 s (all
  16 within about 1.5 s, so they overlap: concurrent). The engine gets each request at its arrival
  time. transformers serves them as a static-batching server does: when it is free and requests wait,
  it runs all of them (at most 16) as one padded `generate` batch, which lasts until its longest row
  is done (rows that end early are padding until then, as in any static batch); requests that arrive
  meanwhile wait for the next batch. Its clock is simulated from the measured `generate` times (time
  idle before the first arrival and between batches counts, as for the engine).
- **burst**: the same answer lengths, all 16 arriving at once: transformers runs one batch of 16 until
  the longest answer (256) is done.
- **prefill-heavy** (the earlier row): all at once, 32 new tokens each: ~4,600 tokens of prompt (4,096
  of them image tokens) against 512 generated, where one static prefill forward costs about what our
  chunked prefill does; kept so that nothing is hidden.

Reported per workload: generated tokens per second of each side (every request's own tokens over the
time from the first arrival to the last answer), their ratio (goal ≥ 2.5× on chat), and the mean time
from a request's arrival to its full answer.

Follow-up turn: conversations whose first turn is an image and a question (a 32-token reply), then a
second turn holding the same image, the first reply and a new question. Reported: the median time to
first token of each turn, from submitting the processed request to the engine (the goal: ≥ 3×
faster), and from the raw chat request (the front end's template, image decoding and processor
included, as a client sees it); and the second turn's prefix-cache hit tokens and images encoded
(the image's blocks are reused and the vision encoder does not run for them). Two kinds of reply:
- **text** (the goal's row): a reply that, put back in the conversation, tokenizes to the ids the
  model generated, as a trained model's reply does. A random model's reply is not text, so both
  turns bias (`logit_bias`) the model to one word token, " the", and the reply goes back without its
  leading space (as LLaVA's own sentencepiece tokenizer decodes it, and as its template expects
  after "ASSISTANT: "). The second turn then reuses the whole first turn, reply included, and
  computes only the new question.
- **random**: the random model's own reply, bytes that are not UTF-8 and come back as U+FFFD, which
  tokenize to other ids: the second turn reuses the first turn's prompt (up to the reply's first
  token) and computes the reply again.
`--follow-up-only` runs the follow-up turns alone (no throughput workloads).

`--family gemma3|paligemma|idefics3|smolvlm|mllama` runs the same on that family's tiny random model
(64 wide, 2 or 3 layers, 32x32 images: 4, 16 and 20 image tokens; tests/tiny_vision_gemma.py,
tests/tiny_vision_idefics.py, tests/tiny_vision_mllama.py): image tokens that attend both ways
(prefilled whole, one chunk each), tiles between text tags, or (Mllama) one image token whose image
the language model reads through cross-attention, on the fallback path (transformers' attention,
no prefix caching: its follow-up turn recomputes the image).

Usage: python benchmarks/vision_bench.py [--quick] [--rounds N] [--family NAME] [--follow-up-only] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
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
FULL = {
    "requests": 16,
    "answer_tokens": (64, 256),  # each chat answer's length, drawn in this range
    "prefill_heavy_tokens": 32,
    "arrival_gap_s": 0.1,  # mean gap of the chat workload's Poisson arrivals
    "conversations": 5,
    "reply_tokens": 32,
    "hidden": 384,
    "layers": 6,
    "image": 128,
}
QUICK = {
    **FULL,
    "requests": 4,
    "answer_tokens": (2, 6),
    "prefill_heavy_tokens": 2,
    "arrival_gap_s": 0.01,
    "conversations": 1,
    "reply_tokens": 4,
    "hidden": 64,
    "layers": 2,
    "image": 32,
}
WORKLOADS = ("chat", "burst", "prefill-heavy")
REPLY_KINDS = ("text", "random")
SEED = 28


@dataclass(frozen=True)
class Arrival:
    at_s: float  # after the first arrival
    new_tokens: int


def workload(name: str, params: dict) -> list[Arrival]:
    """The requests' arrival times and answer lengths (the same for both sides, every round)."""
    rng = random.Random(SEED)
    low, high = params["answer_tokens"]
    lengths = [rng.randint(low, high) for _ in range(params["requests"])]
    if name == "prefill-heavy":
        return [Arrival(0.0, params["prefill_heavy_tokens"]) for _ in lengths]
    if name == "burst":
        return [Arrival(0.0, n) for n in lengths]
    at, arrivals = 0.0, []
    for n in lengths:
        arrivals.append(Arrival(at, n))
        at += rng.expovariate(1 / params["arrival_gap_s"])
    return arrivals


def image_uri(index: int, size: int) -> str:
    colour = ((37 * index) % 256, (91 * index + 50) % 256, (53 * index + 120) % 256)
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat(messages: list[dict], max_tokens: int, logit_bias: dict | None = None) -> pb.ChatCompletionRequest:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if logit_bias:
        body["logit_bias"] = logit_bias
    return json_format.ParseDict(body, pb.ChatCompletionRequest())


def user_turn(index: int, size: int, text: str) -> dict:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": image_uri(index, size)}},
            {"type": "text", "text": text},
        ],
    }


async def processed(front_end: FrontEnd, arrivals: list[Arrival], size: int, first_image: int) -> list:
    """The engine requests (processor outputs) of a workload: image `first_image + i` for request i,
    EOS ignored so that each answer has its own length."""
    requests = []
    for index, arrival in enumerate(arrivals):
        question = f"what is in picture {first_image + index}"
        _, [request] = await front_end.chat(
            chat([user_turn(first_image + index, size, question)], arrival.new_tokens), stream=False
        )
        stopping = request.stopping.__class__(max_new_tokens=arrival.new_tokens, ignore_eos=True)
        requests.append(request.__class__(**{**request.__dict__, "stopping": stopping}))
    return requests


async def engine_run(engine: AsyncEngine, requests: list, arrivals: list[Arrival]) -> tuple[float, list[float]]:
    """Each request submitted at its arrival time: (seconds to the last answer, each one's latency)."""
    started = time.perf_counter()

    async def one(request, arrival: Arrival) -> float:
        await asyncio.sleep(max(0.0, started + arrival.at_s - time.perf_counter()))
        result = await engine.generate(request)
        assert len(result.tokens) == arrival.new_tokens, (len(result.tokens), arrival.new_tokens)
        return time.perf_counter() - started

    done = await asyncio.gather(*(one(r, a) for r, a in zip(requests, arrivals, strict=True)))
    return max(done), [end - a.at_s for end, a in zip(done, arrivals, strict=True)]


def static_server_run(model, requests: list, arrivals: list[Arrival], pad_id: int) -> tuple[float, list[float]]:
    """transformers as a static-batching server: when free, all waiting requests (at most as many as
    the workload has) run as one `generate` batch until its longest answer is done. The clock is
    simulated from the measured batch times: (seconds to the last answer, each one's latency)."""
    now, pending, done = 0.0, list(range(len(requests))), [0.0] * len(requests)
    while pending:
        now = max(now, arrivals[pending[0]].at_s)  # idle until the next arrival
        batch = [i for i in pending if arrivals[i].at_s <= now]
        now += transformers_batch(
            model, [requests[i] for i in batch], pad_id, max(arrivals[i].new_tokens for i in batch)
        )
        for i in batch:
            done[i] = now
        pending = [i for i in pending if i not in batch]
    return now, [end - a.at_s for end, a in zip(done, arrivals, strict=True)]


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
    """One padded `generate` batch (left padding; its vision tower once per image, like ours), every
    row running `new_tokens` (EOS ignored, as the engine's rows do): its seconds."""
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
    """(TTFT from the processed request, TTFT from the raw chat request, the answer's text, the
    prompt's length in tokens)."""
    raw_started = time.perf_counter()
    _, [engine_request] = await front_end.chat(request, stream=False)
    started = time.perf_counter()
    ttft = raw_ttft = None
    text = []
    async for output in engine.generate_stream(engine_request):
        if ttft is None and output.tokens:
            ttft, raw_ttft = time.perf_counter() - started, time.perf_counter() - raw_started
        text += [token.text for token in output.tokens]
    return ttft, raw_ttft, "".join(text), len(engine_request.prompt_token_ids)


async def follow_up(
    engine: AsyncEngine, front_end: FrontEnd, llm_engine, params: dict, index: int, reply_kind: str = "text"
) -> dict:
    """One conversation's two turns (a fresh image): both turns' TTFTs, and what the second reused.
    `reply_kind`: "text" (a reply that tokenizes back to its ids) or "random" (the model's own)."""
    bias = None
    if reply_kind == "text":
        word = llm_engine.tokenizer.encode(" the", add_special_tokens=False)
        if len(word) != 1:
            raise ValueError("the text reply needs a tokenizer with one token for ' the'")
        bias = {str(word[0]): 100}
    first_turn = [user_turn(index, params["image"], "describe this picture in detail")]
    first, first_raw, reply, num_prompt = await first_token_seconds(
        engine, front_end, chat(first_turn, params["reply_tokens"], bias)
    )
    if reply_kind == "text":
        reply = reply.lstrip()
    second_turn = [*first_turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "and its colour?"}]
    hits, encoded = llm_engine.stats().num_prefix_hit_tokens, encoded_images(llm_engine)
    second, second_raw, _, _ = await first_token_seconds(
        engine, front_end, chat(second_turn, params["reply_tokens"], bias)
    )
    return {
        "first_ttft_s": first,
        "second_ttft_s": second,
        "first_raw_ttft_s": first_raw,
        "second_raw_ttft_s": second_raw,
        "second_hit_tokens": llm_engine.stats().num_prefix_hit_tokens - hits,
        "second_encoded_images": encoded_images(llm_engine) - encoded,
        "first_prompt_tokens": num_prompt,
    }


def encoded_images(llm_engine) -> int:
    """Images the engine encoded so far (on Mllama's fallback path: handed to the model's own code)."""
    return llm_engine.vision.num_encoded_images if llm_engine.vision is not None else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every run (default 3; --quick 1)")
    parser.add_argument("--family", choices=["llava", *FAMILIES], default="llava")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--follow-up-only", action="store_true", help="only the follow-up turns")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.follow_up_only:
        args.workloads = []
    params = QUICK if args.quick else FULL
    if args.family != "llava":  # the family's tiny model and its 32x32 images
        params = {**params, "hidden": 64, "layers": 2, "image": 32}
    rounds = args.rounds or (1 if args.quick else 3)
    out = common.output_dir(args.out, args.quick)
    sides = ("engine", "transformers")
    seconds = {(w, s): [] for w in args.workloads for s in sides}
    latency = {(w, s): [] for w in args.workloads for s in sides}
    conversations: dict[str, list[dict]] = {kind: [] for kind in REPLY_KINDS}
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
        pad_id = engine.tokenizer.pad_token_id
        from transformers import AutoModelForImageTextToText

        reference = AutoModelForImageTextToText.from_pretrained(folder).eval()

        async def serve():
            async_engine = AsyncEngine(engine, max_concurrent_requests=64)
            async_engine.start()
            try:
                front_end = FrontEnd.for_engine(async_engine)
                warm_arrivals = [Arrival(0.0, 2)] * 2
                warm = await processed(front_end, warm_arrivals, params["image"], 10_000)
                await engine_run(async_engine, warm, warm_arrivals)
                static_server_run(reference, warm, warm_arrivals, pad_id)
                first_image = 20_000
                for round_index in range(rounds):
                    for name in args.workloads:
                        arrivals = workload(name, params)
                        order = sides if round_index % 2 == 0 else sides[::-1]
                        for side in order:
                            requests = await processed(front_end, arrivals, params["image"], first_image)
                            first_image += 100  # fresh images: no prefix-cache hits across runs
                            if side == "engine":
                                took, waits = await engine_run(async_engine, requests, arrivals)
                            else:
                                took, waits = static_server_run(reference, requests, arrivals, pad_id)
                            seconds[name, side].append(took)
                            latency[name, side].append(statistics.mean(waits))
                kinds = REPLY_KINDS if args.family == "llava" else ("random",)  # text: LLaVA's tokenizer
                for number in range(params["conversations"]):
                    for offset, kind in enumerate(kinds):  # interleaved: a slow spell hits both
                        conversations[kind].append(
                            await follow_up(async_engine, front_end, engine, params, 90_000 + 2 * number + offset, kind)
                        )
            finally:
                await async_engine.shutdown(timeout_s=1)

        asyncio.run(serve())
    summary, results = report(args, params, rounds, seconds, latency, conversations)
    print(summary)
    name = "vision" if args.family == "llava" else f"vision_{args.family}"
    (out / f"{name}.md").write_text(summary)
    common.write_json(out / f"{name}.json", results)


def report(args, params: dict, rounds: int, seconds: dict, latency: dict, conversations: list[dict]):
    rows, results = [], {"family": args.family, "params": params, "rounds": rounds, "workloads": {}}
    for name in args.workloads:
        tokens = sum(a.new_tokens for a in workload(name, params))
        engine_s, hf_s = (statistics.median(seconds[name, side]) for side in ("engine", "transformers"))
        per_round = ", ".join(
            f"{hf / ours:.2f}×" for ours, hf in zip(seconds[name, "engine"], seconds[name, "transformers"], strict=True)
        )
        waits = [statistics.median(latency[name, side]) for side in ("engine", "transformers")]
        rows.append(
            [
                name,
                common.fmt(tokens / engine_s),
                common.fmt(tokens / hf_s),
                f"**{common.ratio(hf_s, engine_s)}** ({per_round})",
                f"{waits[0]:.2f} / {waits[1]:.2f}",
            ]
        )
        results["workloads"][name] = {
            "generated_tokens": tokens,
            "engine_seconds": seconds[name, "engine"],
            "transformers_seconds": seconds[name, "transformers"],
            "engine_mean_latency_s": latency[name, "engine"],
            "transformers_mean_latency_s": latency[name, "transformers"],
            "ratio": hf_s / engine_s,
        }
    table = common.markdown_table(
        [
            f"{params['requests']} image+text requests",
            "engine tok/s",
            "transformers tok/s",
            "engine ÷ transformers (rounds)",
            "mean latency s, engine / transformers",
        ],
        rows,
    )
    low, high = params["answer_tokens"]
    lines = [f"Model: a random {args.family}."]
    if rows:
        lines += [
            "",
            table,
            "",
            f"chat: answers of {low}..{high} new tokens (seeded, one length per request), Poisson arrivals "
            f"(mean gap {params['arrival_gap_s']} s), transformers in static batches of what waits; burst: the "
            f"same answers arriving at once; prefill-heavy: at once, {params['prefill_heavy_tokens']} new tokens "
            f"each. Medians of {rounds} round(s); one image per request.",
        ]
    results["follow_up"] = {}
    for kind, runs in conversations.items():
        if not runs:
            continue
        med = {key: statistics.median(c[key] for c in runs) for key in runs[0]}
        ratios = sorted(c["first_ttft_s"] / c["second_ttft_s"] for c in runs)
        lines += [
            "",
            f"Follow-up turn with the same image, {kind} reply (median of {len(runs)} conversations): TTFT "
            f"{med['first_ttft_s'] * 1000:.0f} ms → {med['second_ttft_s'] * 1000:.0f} ms "
            f"(**{common.ratio(med['first_ttft_s'], med['second_ttft_s'])}** faster; per conversation "
            f"{ratios[0]:.2f}–{ratios[-1]:.2f}×; from the raw chat request, "
            f"front end included: {med['first_raw_ttft_s'] * 1000:.0f} ms → {med['second_raw_ttft_s'] * 1000:.0f} ms, "
            f"{common.ratio(med['first_raw_ttft_s'], med['second_raw_ttft_s'])}); the second turn reused "
            f"{med['second_hit_tokens']:.0f} prompt tokens from the prefix cache and encoded "
            f"{med['second_encoded_images']:.0f} image(s).",
        ]
        results["follow_up"][kind] = {"conversations": runs, "medians": med}
    lines += ["", common.machine_line(common.machine()), ""]
    return "\n".join(lines), results


if __name__ == "__main__":
    main()
