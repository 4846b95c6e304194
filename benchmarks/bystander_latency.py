"""A bystander beside a long prompt: how long a short request takes while the engine prefills a
4k-token prompt, against the same request on an idle engine, in the same run.

The bystander is a short prompt asking for one token (greedy), the request a client uses to check
that the server answers. Alone, it costs one short step. Beside a long prompt it waits for the step
in progress, then shares the next steps with the long prompt's chunks: the scheduler gives it its
prompt in the next step (engine/scheduler.py), so its latency is about two steps of the long
prefill, set by the step budget (--max-batch-prefill-tokens), not by the long prompt's length.

Each bystander is timed from its submission to its final output, through the async engine (the
server's engine thread), so it arrives in the middle of a step as a real request does. The long
prompt is submitted `--delay` seconds before it and cancelled once the bystander is done.

Usage: python benchmarks/bystander_latency.py [--quick] [--model-id ID] [--long-tokens N] [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402
from inference_service.engine.async_engine import AsyncEngine  # noqa: E402

BYSTANDER = "Hello, how are you?"


async def timed(engine: AsyncEngine, request) -> float:
    started = time.perf_counter()
    await engine.generate(request)
    return time.perf_counter() - started


async def measure(engine: AsyncEngine, bystander, long_requests, args: argparse.Namespace) -> dict[str, list[float]]:
    """Each run takes two long prompts of its own (fresh tokens: the prefix cache must not answer them)."""
    await timed(engine, bystander)  # warm-up
    alone, beside, long_alone = [], [], []
    for _ in range(args.runs):
        alone.append(await timed(engine, bystander))
        long_alone.append(await timed(engine, next(long_requests)))  # what the step budget costs a long prompt
        long_task = asyncio.create_task(engine.generate(next(long_requests)))
        await asyncio.sleep(args.delay)  # the long prefill is under way
        beside.append(await timed(engine, bystander))
        long_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long_task
    return {"alone_s": alone, "beside_s": beside, "long_alone_s": long_alone}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--quick", action="store_true", help="the tiny model and a short long prompt")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between the long prompt and the bystander")
    parser.add_argument("--max-batch-prefill-tokens", type=int, default=None, help="default: the device's")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:  # a smoke run: the tiny model (unless another is named), a prompt of 400 tokens
        args.long_tokens, args.runs, args.delay = 400, 1, 0.01
        if args.model_id == DEMO_MODEL_ID:
            args.model_id = tiny_model.TINY_MODEL_ID

    engine, _ = common.load_engine(
        tiny_model.resolve(args.model_id), max_batch_prefill_tokens=args.max_batch_prefill_tokens
    )
    rng = random.Random(0)
    long_requests = (
        common.validated([rng.randrange(3, engine.info.vocab_size) for _ in range(args.long_tokens)], 1)
        for _ in itertools.count()
    )
    bystander = common.validated(engine.tokenizer.encode(BYSTANDER), 1)
    async_engine = AsyncEngine(engine, max_concurrent_requests=8)
    async_engine.start()
    try:
        times = asyncio.run(measure(async_engine, bystander, long_requests, args))
    finally:
        asyncio.run(async_engine.shutdown(timeout_s=5))

    alone, beside = statistics.median(times["alone_s"]), statistics.median(times["beside_s"])
    table = common.markdown_table(
        ["bystander", "median s", "runs (s)"],
        [
            ["alone", common.fmt(alone, 3), ", ".join(common.fmt(t, 3) for t in times["alone_s"])],
            [
                f"beside a {args.long_tokens}-token prompt",
                common.fmt(beside, 3),
                ", ".join(common.fmt(t, 3) for t in times["beside_s"]),
            ],
            [
                f"the {args.long_tokens}-token prompt alone (prefill)",
                common.fmt(statistics.median(times["long_alone_s"]), 3),
                ", ".join(common.fmt(t, 3) for t in times["long_alone_s"]),
            ],
        ],
    )
    budget = engine.info.max_batch_prefill_tokens
    prefill_tps = args.long_tokens / statistics.median(times["long_alone_s"])
    summary = (
        f"beside ÷ alone: {common.ratio(beside, alone)} (step budget {budget} tokens); "
        f"the long prompt alone prefills {prefill_tps:.0f} tokens/s"
    )
    print(f"{common.machine_line(common.machine())}\n{common.command_line()}\n\n{table}\n\n{summary}")
    folder = common.output_dir(args.out, args.quick)
    common.write_json(
        folder / "bystander_latency.json",
        {"args": vars(args), "step_budget": budget, **times, "ratio": beside / alone, "prefill_tps": prefill_tps},
    )


if __name__ == "__main__":
    main()
