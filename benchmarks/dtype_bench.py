"""bf16 (and fp16) against fp32 on the demo model, in one run: single-stream decode ms/token.

A bf16 model reads half the bytes of weights per token; its decode steps go through the native bf16
linear (csrc/bf16_linear.cpp: AVX512-BF16 dot products where the CPU has them). The issue's goal:
bf16 decode ≤ 0.6× fp32's ms/token where the CPU has AVX512-BF16 or AMX. fp16 runs on torch's CPU
path (no native kernel: x86 CPUs without AVX512-FP16 compute it by conversion).

The engines are built once and their decode runs alternate (fp32, bf16, fp32, ...), so a spell of
load on this shared machine hits each dtype alike; per dtype the median step of its fastest run
counts (interference only ever slows a run down).

Usage: python benchmarks/dtype_bench.py [--quick] [--dtypes float32 bfloat16 float16] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

FULL = {"decode_tokens": 64, "rounds": 5}
QUICK = {"decode_tokens": 8, "rounds": 1}
PROMPT_TOKENS = 32
KV_TOKENS = 4096


def build(dtype: str, model_id: str):
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig
    from inference_service.engine.builder import build_engine, warm_up

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model_id=model_id, device="cpu", dtype=dtype),
            cache=CacheConfig(max_batch_total_tokens=KV_TOKENS),  # a small cache: both engines stay in memory
        )
    )
    warm_up(engine)
    return engine


def decode_steps_ms(engine, prompt: list[int], tokens: int) -> list[float]:
    """Each decode step's time (the prefill step left out) of one greedy stream."""
    engine.add_request("bench", common.validated(prompt, tokens))
    steps: list[float] = []
    while engine.has_unfinished():
        started = time.perf_counter()
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"the request failed: {output.error}")
        steps.append(1000 * (time.perf_counter() - started))
    return steps[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few tokens, one round: checks the script runs")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, help="decode tokens per run (default: 64, --quick 8)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default: 5, --quick 1)")
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--out", help="folder for dtype.json / dtype.md (default: benchmarks/results)")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    settings["decode_tokens"] = args.tokens or settings["decode_tokens"]
    settings["rounds"] = args.rounds or settings["rounds"]
    engines = {dtype: build(dtype, args.model_id) for dtype in args.dtypes}
    first = next(iter(engines.values()))
    prompt = first.tokenizer("Once upon a time, in a land far away, there lived a")["input_ids"]
    prompt = (prompt * PROMPT_TOKENS)[:PROMPT_TOKENS]
    runs: dict[str, list[dict]] = {dtype: [] for dtype in engines}
    for _ in range(settings["rounds"]):
        for dtype, engine in engines.items():
            runs[dtype].append(common.summarize(decode_steps_ms(engine, prompt, settings["decode_tokens"])))
    best = {dtype: min(results, key=lambda run: run["p50"]) for dtype, results in runs.items()}
    base = best.get("float32", {}).get("p50", float("nan"))
    rows = [
        [
            dtype,
            engines[dtype].runner.describe(),
            common.fmt(best[dtype]["p50"], 2),
            common.fmt(best[dtype]["p90"], 2),
            common.ratio(best[dtype]["p50"], base),
        ]
        for dtype in engines
    ]
    info = common.machine()
    markdown = "\n\n".join(
        [
            f"Single-stream decode on {args.model_id}, {PROMPT_TOKENS}-token prompt, "
            f"{settings['decode_tokens']} tokens, fastest of {settings['rounds']} alternating rounds.",
            common.markdown_table(["dtype", "decode path", "ms/token p50", "p90", "vs fp32"], rows),
            f"Machine: {common.machine_line(info)}. Command: `{common.command_line()}`",
        ]
    )
    out = common.output_dir(args.out, args.quick)
    common.write_json(out / "dtype.json", {"machine": info, "settings": settings, "runs": runs, "best": best})
    (out / "dtype.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
