"""An fp32 decode step's layers in one native call (runner/fused_layers.py) against the op-by-op plan,
on the same engine in one run, the two alternating each round.

Rows, all with `--threads` threads (2), prefix caching off:
- **f32** and **q4_1** (`--quantize gguf`): one greedy stream of the demo model, a `--context`-token
  prompt, fp16 KV (as peer_bench's rows); per mode the median decode step's wall ms and the main
  thread's CPU ms (what a busy machine's clock hides);
- **lora**: `--streams` streams over `--adapters` adapters (rank 16, all seven projections) on an fp32
  LoRA engine, and the same streams without adapters on it: decode tokens/s per mode.
The op-by-op mode is the same engine with its plan's fused call taken away (`decode_step.fused = None`).
Ratios < 1 (ms) or > 1 (tok/s) mean the fused call is faster.

    python benchmarks/fused_layers.py                               # f32, q4_1 and lora
    python benchmarks/fused_layers.py --rows f32 --tokens 64 --rounds 5
    python benchmarks/fused_layers.py --rows lora --streams 16 --adapters 4
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common, lora_bench, serve_overhead  # noqa: E402
from inference_service.config import DEMO_MODEL_ID, ModelConfig  # noqa: E402
from inference_service.models import loader  # noqa: E402
from tests.lora_adapters import make_adapter  # noqa: E402

MODES = ("op-by-op", "fused")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def one_stream(engine, prompt: list[int], tokens: int) -> tuple[list[float], list[float]]:
    """Each decode step's wall ms and main-thread CPU ms (the prefill steps left out)."""
    engine.add_request(f"bench-{time.monotonic_ns()}", common.validated(prompt, tokens))
    walls, cpus, produced = [], [], 0
    while engine.has_unfinished():
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        wall, cpu = 1000 * (time.perf_counter() - wall), 1000 * (time.thread_time() - cpu)
        if produced:
            walls.append(wall)
            cpus.append(cpu)
        produced += sum(len(output.tokens) for output in outputs)
    return walls, cpus


def switch(engine, fused, mode: str) -> None:
    engine.runner.decode_step.fused = fused if mode == "fused" else None


def stream_row(fmt: str, args) -> None:
    engine = serve_overhead.build_engine(DEMO_MODEL_ID, fmt, args.context, args.tokens, args.threads)
    fused = engine.runner.decode_step.fused
    assert fused is not None, f"{fmt}: the engine's decode plan has no fused call"
    prompt = serve_overhead.prompt_ids(engine.tokenizer, args.context)
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    cpus: dict[str, list[float]] = {m: [] for m in MODES}
    for round_ in range(args.rounds):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            switch(engine, fused, mode)
            wall, cpu = one_stream(engine, prompt, args.tokens)
            walls[mode] += wall
            cpus[mode] += cpu
    for name, values in (("wall ms/step", walls), ("main-thread CPU ms/step", cpus)):
        before, after = (statistics.median(values[m]) for m in MODES)
        print(f"{fmt:6} {name:24} op-by-op {before:7.2f}  fused {after:7.2f}  fused/op-by-op {after / before:.3f}")
    engine.close()


def lora_row(args) -> None:
    path = loader.resolve_model(ModelConfig(model_id=DEMO_MODEL_ID)).path
    workdir = Path(tempfile.mkdtemp(prefix="fused-lora-"))
    names = [f"a{i}" for i in range(args.adapters)]
    spec = ",".join(
        f"{name}={make_adapter(path, workdir / name, seed=i, rank=16, targets=TARGETS, scale=0.02)}"
        for i, name in enumerate(names)
    )
    engine = lora_bench._engine(DEMO_MODEL_ID, spec)
    fused = engine.runner.decode_step.fused
    assert fused is not None, "lora: the engine's decode plan has no fused call"
    workload = common.make_workload(args.streams, (args.context,) * 2, (args.tokens,) * 2, engine.info.vocab_size)
    cases = {"mixed": [names[i % len(names)] for i in range(args.streams)], "no adapter": [None] * args.streams}
    rates: dict[tuple[str, str], list[float]] = {(c, m): [] for c in cases for m in MODES}
    for round_ in range(args.rounds):
        for case, adapters in cases.items():
            for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
                switch(engine, fused, mode)
                rates[case, mode].append(lora_bench._decode_rate(engine, workload.prompts, adapters, args.tokens))
    for case in cases:
        rounds = "  ".join(f"{b:.0f}/{a:.0f}" for b, a in zip(*(rates[case, m] for m in MODES), strict=True))
        print(f"lora   {case:10} per round, op-by-op/fused tok/s: {rounds}")
        before, after = (statistics.median(rates[case, m]) for m in MODES)
        print(
            f"lora   {args.streams} streams, {case:10} tok/s op-by-op {before:7.1f}  fused {after:7.1f}  "
            f"fused/op-by-op {after / before:.3f}"
        )
    engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=["f32", "q4_1", "lora"], choices=["f32", "q4_1", "lora"])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens (per stream)")
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="1 holds up better on a busy machine")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for row in args.rows:
        if row == "lora":
            lora_row(args)
        else:
            stream_row(row, args)
        gc.collect()


if __name__ == "__main__":
    main()
