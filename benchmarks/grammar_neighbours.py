"""A short greedy request beside hostile grammars compiling: its latency while two grammars that
burn their whole compile budget (`a{1000000}`-like regexes, a new one each time) keep the grammar
compiler's threads busy, against the same request with nothing else running, with the compiler
threads at niceness 0 (the baseline: the engine's own priority) and at the budget's default
niceness, in the same run, interleaved round by round.

On a machine with as many cores as compiler threads, threads at niceness 0 take half the CPU from
the engine thread (and the API's); niced, they get what the engine leaves.

Usage: python benchmarks/grammar_neighbours.py [--quick] [--model-id ID] [--rounds N] [--runs N]
       [--niceness N ...]   (compiler niceness levels to compare; 0 is always the baseline)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402
from inference_service.engine.async_engine import AsyncEngine  # noqa: E402
from inference_service.sample.grammar import GrammarBudget, GrammarCompiler, GrammarSpec  # noqa: E402

BYSTANDER = "Hello, how are you?"
HOSTILE = "a{1000000}"  # its first mask costs seconds of lexer work: over any budget


def keep_compiling(compiler: GrammarCompiler, stop: threading.Event, count: itertools.count) -> None:
    """One hostile client: a new expensive grammar after another until stopped."""
    while not stop.is_set():
        with contextlib.suppress(Exception):  # refused (too complex, overloaded): its expected answer
            compiler.compile(GrammarSpec("regex", f"{HOSTILE}|b{next(count)}"))


async def timed(engine: AsyncEngine, request) -> float:
    started = time.perf_counter()
    await engine.generate(request)
    return time.perf_counter() - started


def run_beside(engine: AsyncEngine, request, runs: int, compiler: GrammarCompiler | None) -> list[float]:
    stop, count = threading.Event(), itertools.count()
    clients = [
        threading.Thread(target=keep_compiling, args=(compiler, stop, count), daemon=True)
        for _ in range(compiler.budget.max_concurrent if compiler else 0)
    ]
    for client in clients:
        client.start()
    if clients:
        time.sleep(0.2)  # the compiler threads busy
    try:
        return [asyncio.run(timed(engine, request)) for _ in range(runs)]
    finally:
        stop.set()
        for client in clients:
            client.join()
        while compiler is not None and compiler.num_running:  # the last ones run out their budget
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--quick", action="store_true", help="the tiny model, few runs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20, help="bystander requests per round and setting")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--niceness", type=int, nargs="+", default=[GrammarBudget().niceness])
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.runs = 2, 8
        if args.model_id == DEMO_MODEL_ID:
            args.model_id = tiny_model.TINY_MODEL_ID

    engine, _ = common.load_engine(tiny_model.resolve(args.model_id))
    info = engine.info
    levels = [0, *[n for n in args.niceness if n != 0]]
    compilers = {
        n: GrammarCompiler(engine.tokenizer, info.vocab_size, info.eos_token_ids, budget=GrammarBudget(niceness=n))
        for n in levels
    }
    request = common.validated(engine.tokenizer.encode(BYSTANDER), args.max_new_tokens)
    async_engine = AsyncEngine(engine, max_concurrent_requests=8)
    async_engine.start()
    times: dict[str, list[float]] = {"alone": [], **{f"niceness {n}": [] for n in levels}}
    try:
        run_beside(async_engine, request, 2, None)  # warm
        for _ in range(args.rounds):
            times["alone"] += run_beside(async_engine, request, args.runs, None)
            for n in levels:
                times[f"niceness {n}"] += run_beside(async_engine, request, args.runs, compilers[n])
    finally:
        asyncio.run(async_engine.shutdown(timeout_s=5))

    alone = statistics.median(times["alone"])
    rows = []
    for name, values in times.items():
        rows.append(
            [
                name,
                common.fmt(statistics.median(values) * 1000, 1),
                common.ratio(statistics.median(values), alone),
                common.ratio(common.percentile(values, 95), alone),
                common.ratio(max(values), alone),
            ]
        )
    print(common.machine_line(common.machine()))
    print(common.command_line())
    print(
        common.markdown_table(
            ["bystander", "median (ms)", "median ÷ alone", "p95 ÷ alone median", "max ÷ alone median"], rows
        )
    )


if __name__ == "__main__":
    main()
