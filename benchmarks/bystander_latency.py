"""Bystanders beside a long prompt: how long short requests take while the engine prefills a
4k-token prompt, against the same requests on an idle engine, under the scheduler's two ways of
counting a step's budget, in the same run.

Two bystanders, each timed through the async engine (the server's engine thread), so it arrives in
the middle of a step as a real request does:

- a **new request**: a short prompt asking for one token (greedy), the request a client uses to check
  that the server answers; timed from its submission to its final output. It waits for the step in
  progress, then for the step that computes it.
- a **stream**: the same prompt generating `--stream-tokens` tokens; its per-token latency is the
  median gap between its tokens. Each of its tokens waits for a step that also carries a prefill chunk.

The long prompt is submitted `--delay` seconds before the bystander and cancelled once it is done.
Each run also times a long prompt alone (its time to first token: what the policy costs it), and a
long prompt that a new request arrives beside (its time to first token then: what an arrival costs
it).

Policies (engine/step_cost.py): `tokens` counts a step's budget in tokens, whatever their context,
and gives prefills the whole budget in every step; `work` counts a chunk's attention over its context
too, and gives prefills a fixed small pool (1/16 of the budget) in a step that carries streams;
`clock` (the engine's default) sizes that pool from the step times it has measured, so that such a
step takes at most STREAM_STEP_RATIO times the same step without the prefill. Each policy keeps its
own clock, so one's steps do not teach another's. In all three a lone prefill step gives way to a new
request between decoder layers (engine/step_yield.py); `clock-whole` is `clock` with whole steps,
the engine before that.

Usage: python benchmarks/bystander_latency.py [--quick] [--model-id ID] [--long-tokens N] [--runs N]
       [--policies clock clock-whole]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
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
from inference_service.engine.step_cost import STREAM_STEP_RATIO, StepClock, StepCost  # noqa: E402

BYSTANDER = "Hello, how are you?"
POLICIES = ("tokens", "work", "clock", "clock-whole")
KEYS = ("alone_s", "beside_s", "stream_alone_s", "stream_beside_s", "long_alone_s", "long_arrival_s")


async def timed(engine: AsyncEngine, request) -> float:
    started = time.perf_counter()
    await engine.generate(request)
    return time.perf_counter() - started


async def per_token(engine: AsyncEngine, request) -> float:
    """The median gap between a stream's tokens (its first token excluded)."""
    stamps = []
    async for _ in engine.generate_stream(request):
        stamps.append(time.perf_counter())
    return statistics.median(b - a for a, b in itertools.pairwise(stamps))


async def beside(engine: AsyncEngine, long_request, bystander, delay: float) -> float:
    long_task = asyncio.create_task(engine.generate(long_request))
    await asyncio.sleep(delay)  # the long prefill is under way
    try:
        return await bystander
    finally:
        long_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long_task
        await idle(engine)


async def long_with_arrival(engine: AsyncEngine, long_request, bystander, delay: float) -> float:
    """The long prompt's time to its first token when a new request arrives `delay` s after it."""
    started = time.perf_counter()
    long_task = asyncio.create_task(engine.generate(long_request))
    await asyncio.sleep(delay)
    await bystander
    await long_task
    return time.perf_counter() - started


async def idle(engine: AsyncEngine) -> None:
    """Until the cancelled long prompt is gone: its abort is applied between steps, so by then its
    last step has ended and the next measurement does not wait for it."""
    while (stats := engine.stats()).num_running or stats.num_waiting:
        await asyncio.sleep(0.005)


async def measure(engine: AsyncEngine, set_policy, requests, long_requests, args) -> dict[str, dict[str, list[float]]]:
    """Each run measures every policy, one after the other (the order turned by one each run, so
    none always follows the same one); every long prompt is fresh random tokens (the prefix cache
    must not answer it)."""
    one, stream = requests
    await timed(engine, one)  # warm-up
    times = {policy: {key: [] for key in KEYS} for policy in args.policies}
    for run in range(args.runs):
        turn = run % len(args.policies)
        for policy in args.policies[turn:] + args.policies[:turn]:
            set_policy(policy)
            row = times[policy]
            row["alone_s"].append(await timed(engine, one))
            row["stream_alone_s"].append(await per_token(engine, stream))
            row["long_alone_s"].append(await timed(engine, next(long_requests)))
            row["beside_s"].append(await beside(engine, next(long_requests), timed(engine, one), args.delay))
            row["stream_beside_s"].append(
                await beside(engine, next(long_requests), per_token(engine, stream), args.delay)
            )
            row["long_arrival_s"].append(
                await long_with_arrival(engine, next(long_requests), timed(engine, one), args.delay)
            )
    return times


def clock_line(clock) -> str:
    if clock is None or clock.share() is None:
        return "not learned"
    return (
        f"fixed {clock.fixed_s * 1000:.1f} ms, {clock.per_work_s * 1000:.2f} ms per unit of work, "
        f"share {clock.share():.1f} units (step ≤ {STREAM_STEP_RATIO}× its streams' own)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--quick", action="store_true", help="the tiny model and a short long prompt")
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--stream-tokens", type=int, default=9)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between the long prompt and the bystander")
    parser.add_argument("--max-batch-prefill-tokens", type=int, default=None, help="default: the device's")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:  # a smoke run: the tiny model (unless another is named), a prompt of 400 tokens
        args.long_tokens, args.runs, args.delay, args.stream_tokens = 400, 1, 0.01, 3
        if args.model_id == DEMO_MODEL_ID:
            args.model_id = tiny_model.TINY_MODEL_ID

    engine, _ = common.load_engine(
        tiny_model.resolve(args.model_id), max_batch_prefill_tokens=args.max_batch_prefill_tokens
    )
    default = engine.scheduler.cost
    costs = {
        "tokens": StepCost(),
        "work": dataclasses.replace(default, clock=None),
        "clock": default,
        "clock-whole": dataclasses.replace(default, clock=StepClock()),
    }

    def set_policy(policy: str) -> None:  # between requests: the engine thread is idle
        engine.scheduler.cost = costs[policy]
        engine.step_yield.enabled = policy != "clock-whole"

    rng = random.Random(0)
    long_requests = (
        common.validated([rng.randrange(3, engine.info.vocab_size) for _ in range(args.long_tokens)], 1)
        for _ in itertools.count()
    )
    prompt = engine.tokenizer.encode(BYSTANDER)
    requests = (common.validated(prompt, 1), common.validated(prompt, args.stream_tokens))
    async_engine = AsyncEngine(engine, max_concurrent_requests=8)
    async_engine.start()
    try:
        times = asyncio.run(measure(async_engine, set_policy, requests, long_requests, args))
    finally:
        asyncio.run(async_engine.shutdown(timeout_s=5))

    med = {policy: {key: statistics.median(values) for key, values in row.items()} for policy, row in times.items()}
    base = "clock-whole" if "clock-whole" in med else args.policies[0]  # the long prompt's cost ÷ this

    def spread(policy: str, key: str, alone_key: str) -> str:
        """The run-by-run ratios (each run's bystander ÷ the same run's alone), lowest–highest."""
        row = times[policy]
        ratios = [b / a for b, a in zip(row[key], row[alone_key], strict=True)]
        return f"{min(ratios):.2f}–{max(ratios):.2f}"

    rows = []
    for policy in args.policies:
        m = med[policy]
        rows.append(
            [
                policy,
                common.fmt(m["alone_s"], 3),
                common.fmt(m["beside_s"], 3),
                common.ratio(m["beside_s"], m["alone_s"]),
                spread(policy, "beside_s", "alone_s"),
                common.fmt(m["stream_alone_s"] * 1000, 0),
                common.fmt(m["stream_beside_s"] * 1000, 0),
                common.ratio(m["stream_beside_s"], m["stream_alone_s"]),
                spread(policy, "stream_beside_s", "stream_alone_s"),
                common.fmt(m["long_alone_s"], 2),
                common.ratio(m["long_alone_s"], med[base]["long_alone_s"]),
                common.fmt(m["long_arrival_s"], 2),
                common.ratio(m["long_arrival_s"], m["long_alone_s"]),
            ]
        )
    table = common.markdown_table(
        [
            "policy",
            "new request alone s",
            "beside s",
            "beside ÷ alone",
            "runs",
            "stream ms/token alone",
            "beside",
            "beside ÷ alone",
            "runs",
            f"{args.long_tokens}-token prompt alone, TTFT s",
            f"÷ {base}",
            "with a new request arriving, TTFT s",
            "÷ alone",
        ],
        rows,
    )
    budget = engine.info.max_batch_prefill_tokens
    summary = (
        f"step budget {budget}; medians of {args.runs} run(s), every policy in every run; "
        f"context scale {costs['work'].context_scale:.0f} keys, stream share {costs['work'].stream_share:g}; "
        f"clock: {clock_line(default.clock)}; {engine.step_yield.num_yields} steps gave way "
        f"({engine.step_yield.wasted_s:.2f} s thrown away)"
    )
    print(f"{common.machine_line(common.machine())}\n{common.command_line()}\n\n{table}\n\n{summary}")
    folder = common.output_dir(args.out, args.quick)
    common.write_json(folder / "bystander_latency.json", {"args": vars(args), "step_budget": budget, **times})


if __name__ == "__main__":
    main()
