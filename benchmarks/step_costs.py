"""What a decode step costs outside the decoder layers, with the fast paths for it on and off, in one
process, rounds interleaved (the order alternating), as same-run ratios (on ÷ off).

The paths, each with a fallback that computes the same thing: the sampler's native pass for each
row's argmax, max and log-sum-exp (off: torch's max and a whole log_softmax), the detokenizer's
direct call of the fast tokenizer (off: transformers' decode), and a quantized head's few-row
kernel (off: the panel GEMM's tiles; a GGUF's Q8_0 head). Per round, the median over its decode
steps of: the step's wall time, the engine thread's CPU time, that CPU time less the decode
forward's (the engine's Python, the sampler, the text), and the head's CPU time. On a busy machine
compare the CPU times at `--num-threads 1`: they leave out the time the process waited for a core.

Usage: python benchmarks/step_costs.py [--model-id ID|PATH.gguf] [--quantize gguf] [--batch-size 1]
                                       [--tokens 40] [--rounds 6] [--num-threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

PROMPT = "Once upon a time, in a land far away, there lived a"
PROMPT_TOKENS = 128
COLUMNS = ("step wall", "step CPU", "CPU outside the forward", "head CPU")


class CpuTimer:
    """Wraps a callable; `seconds` adds up the calling thread's CPU time in it."""

    def __init__(self, function: Callable) -> None:
        self.function, self.seconds = function, 0.0

    def __call__(self, *args, **kwargs):
        started = time.thread_time()
        try:
            return self.function(*args, **kwargs)
        finally:
            self.seconds += time.thread_time() - started


class Switch:
    """The engine's step-cost fast paths, on or off."""

    def __init__(self, engine) -> None:
        from inference_service.engine import detokenizer

        self.engine, self.directs = engine, detokenizer._DIRECT
        self.tokenizer_type = type(engine.tokenizer)
        self.row_stats = engine.sampler.row_stats
        self.head = engine.runner.decode_step.lm_head
        self.head_kernels = self.head._native_kernels() if hasattr(self.head, "_native_kernels") else None

    def set(self, on: bool) -> None:
        self.engine.sampler.row_stats = self.row_stats if on else None
        self.directs[self.tokenizer_type] = on
        if self.head_kernels is not None:
            self.head._kernel = self.head_kernels if on else (*self.head_kernels[:3], None)


def build(args):
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig
    from inference_service.engine.builder import build_engine, warm_up

    model = ModelConfig(
        model_id=args.model_id, device="cpu", dtype="float32", num_threads=args.num_threads, quantize=args.quantize
    )
    engine = build_engine(
        EngineConfig(model=model, cache=CacheConfig(max_batch_total_tokens=16384, prefix_caching=False))
    )
    warm_up(engine)
    return engine


def run(engine, prompt: list[int], args, forward: CpuTimer, head: CpuTimer) -> list[float]:
    """One round: the medians of COLUMNS over its decode steps (the first two and the last left out), ms."""
    for index in range(args.batch_size):
        engine.add_request(f"r{index}", common.validated(prompt, args.tokens))
    steps: list[tuple[float, float, float, float]] = []
    first = True
    while engine.has_unfinished():
        forward.seconds = head.seconds = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if not first:  # the prefill
            steps.append((wall, cpu, cpu - forward.seconds, head.seconds))
        first = False
    kept = steps[2:-1]
    return [1000 * statistics.median(step[i] for step in kept) for i in range(len(COLUMNS))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--quantize", default=None, help="gguf, with --model-id a .gguf file")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=40, help="decode tokens per request and round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per setting")
    parser.add_argument("--num-threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    engine = build(args)
    step = engine.runner.decode_step
    if step is None:
        raise SystemExit("this model's decode steps do not run through the decode plan (runner/decode_step.py)")
    switch = Switch(engine)  # before the timers wrap the head
    step.forward = forward = CpuTimer(step.forward)
    step.lm_head = head = CpuTimer(step.lm_head)
    prompt = (engine.tokenizer(PROMPT)["input_ids"] * PROMPT_TOKENS)[:PROMPT_TOKENS]
    rounds: dict[bool, list[list[float]]] = {False: [], True: []}
    for number in range(args.rounds):
        for on in (False, True) if number % 2 == 0 else (True, False):
            switch.set(on)
            rounds[on].append(run(engine, prompt, args, forward, head))
    switch.set(True)
    rows = []
    for column, name in enumerate(COLUMNS):
        off = statistics.median(r[column] for r in rounds[False])
        on = statistics.median(r[column] for r in rounds[True])
        pairs = sorted(a[column] / b[column] for a, b in zip(rounds[True], rounds[False], strict=True) if b[column])
        rows.append(
            [name, common.fmt(off, 3), common.fmt(on, 3), common.ratio(on, off), " ".join(f"{p:.2f}" for p in pairs)]
        )
    header = ["per decode step", "off ms", "on ms", "on ÷ off", "per-round ratios"]
    print(
        f"Step costs outside the layers, {args.model_id}{', ' + args.quantize if args.quantize else ''}, "
        f"{args.batch_size} streams, {args.num_threads} threads, medians of {args.rounds} rounds per setting.\n\n"
        + common.markdown_table(header, rows)
    )
    print(f"\nMachine: {common.machine_line(common.machine())}. Command: `{common.command_line()}`")


if __name__ == "__main__":
    main()
