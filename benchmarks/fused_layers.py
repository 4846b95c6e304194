"""An fp32 decode step's layers in one native call (runner/fused_layers.py) against the op-by-op plan,
on the same engine in one run, the two alternating each round.

Rows, all with `--threads` threads (2), prefix caching off:
- **f32** and **q4_1** (`--quantize gguf`): one greedy stream of the demo model, a `--context`-token
  prompt, fp16 KV (as peer_bench's rows);
- **lora**: `--streams` streams over `--adapters` adapters (rank 16, all seven projections) on an fp32
  LoRA engine, and the same streams without adapters on it.
The mode flips every decode step (op by op: the same engine with its plan's fused call taken away,
`decode_step.fused = None`), so both modes see the same contexts and the same load on a busy machine;
per mode the median decode step's wall ms and main-thread CPU ms over `--rounds` runs. Ratios < 1
mean the fused call is faster.

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


def decode_steps(engine, requests: list, modes: dict[str, list[tuple[float, float, int]]]) -> None:
    """Runs the requests to the end, the mode flipping every step (both see the same contexts and the
    same machine); per decode-only step (wall ms, main-thread CPU ms, tokens) into its mode's list."""
    fused = engine.runner.decode_step.fused
    for request in requests:
        engine.add_request(f"bench-{time.monotonic_ns()}", request)
    observed: list = []
    engine.step_observer = observed.append
    index = 0
    while engine.has_unfinished():
        mode = MODES[index % 2]
        engine.runner.decode_step.fused = fused if mode == "fused" else None
        observed.clear()
        wall, cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        wall, cpu = 1000 * (time.perf_counter() - wall), 1000 * (time.thread_time() - cpu)
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(str(output.error))
        if observed and observed[0].num_prefill_requests == 0:  # a decode-only step
            modes[mode].append((wall, cpu, observed[0].num_decode_tokens))
            index += 1
    engine.step_observer = None
    engine.runner.decode_step.fused = fused


def report(label: str, modes: dict[str, list[tuple[float, float, int]]]) -> None:
    for column, name in ((0, "wall ms/step"), (1, "main-thread CPU ms/step")):
        before, after = (statistics.median(step[column] for step in modes[m]) for m in MODES)
        print(f"{label:24} {name:24} op-by-op {before:7.2f}  fused {after:7.2f}  fused/op-by-op {after / before:.3f}")
    rows = statistics.median(step[2] for step in modes["fused"])
    before, after = (statistics.median(step[0] for step in modes[m]) for m in MODES)
    print(
        f"{label:24} {'tok/s (median step)':24} op-by-op {1000 * rows / before:7.1f}  fused {1000 * rows / after:7.1f}"
    )


def stream_row(fmt: str, args) -> None:
    engine = serve_overhead.build_engine(DEMO_MODEL_ID, fmt, args.context, args.tokens, args.threads)
    assert engine.runner.decode_step.fused is not None, f"{fmt}: the engine's decode plan has no fused call"
    prompt = serve_overhead.prompt_ids(engine.tokenizer, args.context)
    modes: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        decode_steps(engine, [common.validated(prompt, args.tokens)], modes)
    report(f"{fmt} one stream", modes)
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
    assert engine.runner.decode_step.fused is not None, "lora: the engine's decode plan has no fused call"
    workload = common.make_workload(args.streams, (args.context,) * 2, (args.tokens,) * 2, engine.info.vocab_size)
    cases = {"mixed": [names[i % len(names)] for i in range(args.streams)], "no adapter": [None] * args.streams}
    for case, adapters in cases.items():
        modes: dict[str, list[tuple[float, float, int]]] = {m: [] for m in MODES}
        for _ in range(args.rounds):
            requests = [
                lora_bench._with_adapter(common.validated(prompt, args.tokens), adapter)
                for prompt, adapter in zip(workload.prompts, adapters, strict=True)
            ]
            decode_steps(engine, requests, modes)
        report(f"lora {args.streams} streams {case}", modes)
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
