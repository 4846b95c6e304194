"""Per-token decode cost of JSON-schema-constrained generation vs free generation, same run.

Each batch size runs free and constrained batches alternately (greedy, the same random prompts),
both generating exactly `--decode-tokens` tokens: the free requests ignore EOS, and the schema (an
array of at least 10,000 short strings) cannot be complete sooner. The constrained cost is the
grammar's: the masks of all rows (filled together in llguidance's thread pool), applying them, and
advancing each matcher. The issue's goal: under 10% overhead at batch 16.

Usage: python benchmarks/grammar_bench.py [--quick] [--model-id ID] [--batch-sizes 1 16 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402
from inference_service.sample.grammar import GrammarSpec  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 10000}
FULL = {"batch_sizes": [1, 16], "prompt_tokens": 32, "decode_tokens": 64, "runs": 3, "warmups": 1}
QUICK = {"batch_sizes": [1, 2], "prompt_tokens": 16, "decode_tokens": 8, "runs": 1, "warmups": 1}


def run_batch(engine, prompts: list[list[int]], decode_tokens: int, grammar) -> tuple[list[float], list[float]]:
    """Seconds of each decode step and the sampling part of each (the prefill step excluded)."""
    sample_s: list[float] = []
    engine.step_observer = lambda stats: sample_s.append(stats.sample_s)
    for index, prompt in enumerate(prompts):
        engine.add_request(
            f"bench-{index}", dataclasses.replace(common.validated(prompt, decode_tokens), grammar=grammar)
        )
    engine.step()  # the prefill and first token
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        outputs = engine.step()
        steps.append(time.perf_counter() - start)
        failed = [o.error for o in outputs if o.error is not None]
        if failed:
            raise RuntimeError(f"a request failed: {failed[0]}")
    engine.step_observer = None
    if len(steps) != decode_tokens - 1:
        raise RuntimeError(f"{len(steps)} decode steps, expected {decode_tokens - 1}: a request ended early")
    return steps, sample_s[1:]


def measure(engine, args: argparse.Namespace) -> list[dict]:
    compiled = engine.grammar_compiler.compile(GrammarSpec("json", json.dumps(SCHEMA)))
    results = []
    with tqdm(
        total=len(args.batch_sizes) * (args.runs + args.warmups) * 2, desc="grammar bench", file=sys.stderr
    ) as progress:
        for batch_size in args.batch_sizes:
            workload = common.make_workload(
                batch_size,
                (args.prompt_tokens,) * 2,
                (args.decode_tokens,) * 2,
                engine.info.vocab_size,
                seed=batch_size,
            )
            samples = {"free": ([], []), "json": ([], [])}
            for run in range(args.warmups + args.runs):
                for name, grammar in (("free", None), ("json", compiled)):  # alternate: same conditions
                    steps, sample_s = run_batch(engine, workload.prompts, args.decode_tokens, grammar)
                    if run >= args.warmups:
                        samples[name][0].extend(steps)
                        samples[name][1].extend(sample_s)
                    progress.update()
            results.append(
                {
                    "batch_size": batch_size,
                    **{
                        name: {
                            "step_ms": common.summarize([1000 * s for s in steps]),
                            "sample_ms": common.summarize([1000 * s for s in sample_s]),
                        }
                        for name, (steps, sample_s) in samples.items()
                    },
                }
            )
    return results


def report(results: list[dict], args: argparse.Namespace, engine) -> str:
    rows = []
    for r in results:
        free, constrained = r["free"], r["json"]
        rows.append(
            [
                r["batch_size"],
                common.fmt(free["step_ms"]["avg"]),
                common.fmt(constrained["step_ms"]["avg"]),
                common.ratio(constrained["step_ms"]["avg"], free["step_ms"]["avg"]),
                common.fmt(free["sample_ms"]["avg"], 2),
                common.fmt(constrained["sample_ms"]["avg"], 2),
            ]
        )
    name = "tiny random Llama" if args.model_id == tiny_model.TINY_MODEL_ID else engine.info.model_id
    table = common.markdown_table(
        ["batch", "free ms/step", "JSON schema ms/step", "ratio", "free sampling ms", "JSON sampling ms"], rows
    )
    return (
        f"#### Grammar overhead: {name} ({engine.info.dtype}, {engine.info.device})\n\n"
        f"Greedy decode steps, {args.prompt_tokens}-token prompts, {args.decode_tokens} tokens each, "
        f"{args.runs} runs after {args.warmups} warm-up; same run, alternating. Sampling = the step after "
        f"the forward pass (masks, sampler, matchers, text).\n\n{table}\n\n"
        f"{common.machine_line(common.machine())}\n\n`{common.command_line()}`\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help=f"model to load (default: {DEMO_MODEL_ID}; quick: a tiny random model)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, batch 1 and 2, 8 tokens")
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--decode-tokens", type=int)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--warmups", type=int)
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    if args.model_id is None:
        args.model_id = tiny_model.TINY_MODEL_ID if args.quick else DEMO_MODEL_ID
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.decode_tokens < 2 or args.runs < 1:
        parser.error("need --decode-tokens >= 2 and --runs >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    out = common.output_dir(args.out, args.quick)
    budget = common.one_step_prefill_budget(max(args.batch_sizes), args.prompt_tokens)
    engine, _ = common.load_engine(tiny_model.resolve(args.model_id), max_batch_prefill_tokens=budget)
    if engine.grammar_compiler is None:
        raise SystemExit("this model's tokenizer has no grammar support")
    results = measure(engine, args)
    markdown = report(results, args, engine)
    (out / "grammar.md").write_text(markdown)
    common.write_json(out / "grammar.json", {"args": vars(args), "machine": common.machine(), "results": results})
    print("\n" + markdown)
    print(f"written: {out / 'grammar.md'}, {out / 'grammar.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
