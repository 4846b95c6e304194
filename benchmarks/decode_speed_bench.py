"""GGUF Q4_1 and bf16 against fp32 on the demo model, in one run: single-stream decode ms/token after
a short and after a long prompt.

The goals: 4-bit short-context decode at or under llama.cpp Q4_1's ms/token (7.2 ms against our 10.7
when measured with fp32 at 23.9, demo model, 2 threads: a same-run Q4_1 ÷ fp32 of about 0.30 or
less), 4-bit decode growing with context no faster than llama.cpp's (~3.5 ms/token from a short
prompt to ~1,500 tokens), and bf16 (`--dtype bfloat16`, native bf16 kernels) at most 0.6x fp32's
ms/token. The Q4_1 weights are the demo model's own GGUF file (`--quantize gguf`). Prefix caching is
off, so each run prefills its prompt.

The engines are built once and their runs alternate (fp32, Q4_1, bf16, fp32, ...), so a spell of
load on a shared machine hits each alike; per engine and prompt the median step of its fastest run
counts.

Usage: python benchmarks/decode_speed_bench.py [--quick] [--schemes fp32 gguf bf16] [--contexts 32 1500]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

FULL = {"decode_tokens": 64, "rounds": 3, "contexts": [32, 1500]}
QUICK = {"decode_tokens": 8, "rounds": 1, "contexts": [32]}
LABELS = {"fp32": "fp32", "gguf": "GGUF Q4_1", "bf16": "bf16"}
KV_TOKENS = 4096


def build(scheme: str, model_id: str):
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig
    from inference_service.engine.builder import build_engine, warm_up

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(
                model_id=model_id,
                device="cpu",
                quantize="gguf" if scheme == "gguf" else None,
                dtype="bfloat16" if scheme == "bf16" else "auto",
            ),
            cache=CacheConfig(max_batch_total_tokens=KV_TOKENS, prefix_caching=False),
        )
    )
    warm_up(engine)
    return engine


def greedy_stream(engine, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    """One greedy stream: its token ids and each decode step's ms (the prefill steps left out)."""
    engine.add_request("bench", common.validated(prompt, tokens))
    produced: list[int] = []
    steps: list[float] = []
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = 1000 * (time.perf_counter() - started)
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"the request failed: {output.error}")
        if produced:  # the step that produced the first token was (the end of) the prefill
            steps.append(elapsed)
        for output in outputs:
            produced.extend(token.id for token in output.tokens)
    return produced, steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few tokens, one round: checks the script runs")
    parser.add_argument("--schemes", nargs="+", default=list(LABELS), choices=list(LABELS))
    parser.add_argument("--contexts", nargs="+", type=int, help="prompt lengths (default: 32 1500)")
    parser.add_argument("--tokens", type=int, help="decode tokens per run (default: 64, --quick 8)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default: 3, --quick 1)")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--out", help="folder for decode_speed.json / .md (default: benchmarks/results)")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    settings["decode_tokens"] = args.tokens or settings["decode_tokens"]
    settings["rounds"] = args.rounds or settings["rounds"]
    settings["contexts"] = args.contexts or settings["contexts"]
    torch.set_num_threads(args.num_threads)
    engines = {scheme: build(scheme, args.model_id) for scheme in args.schemes}
    first = next(iter(engines.values()))
    text = first.tokenizer("Once upon a time, in a land far away, there lived a")["input_ids"]
    prompts = {length: (text * (length // len(text) + 1))[:length] for length in settings["contexts"]}
    runs: dict[str, dict[int, list[dict]]] = {s: {length: [] for length in prompts} for s in engines}
    for _ in range(settings["rounds"]):
        for length, prompt in prompts.items():
            for scheme, engine in engines.items():
                _, steps = greedy_stream(engine, prompt, settings["decode_tokens"])
                runs[scheme][length].append(common.summarize(steps))
    best = {s: {n: min(r, key=lambda run: run["p50"]) for n, r in per.items()} for s, per in runs.items()}
    short = min(prompts)
    rows = []
    for scheme in engines:
        for length in prompts:
            p50 = best[scheme][length]["p50"]
            base = best.get("fp32", {}).get(length, {}).get("p50", float("nan"))
            growth = p50 - best[scheme][short]["p50"]
            rows.append(
                [
                    LABELS[scheme],
                    str(length),
                    common.fmt(p50, 2),
                    common.fmt(best[scheme][length]["p90"], 2),
                    common.ratio(p50, base),
                    common.fmt(growth, 2) if length != short else "",
                ]
            )
    info = common.machine()
    markdown = "\n\n".join(
        [
            f"Single-stream decode on {args.model_id}, {args.num_threads} threads, {settings['decode_tokens']} "
            f"tokens after each prompt, fastest of {settings['rounds']} alternating rounds.",
            common.markdown_table(
                ["weights", "prompt tokens", "ms/token p50", "p90", "vs fp32", "growth from short (ms)"], rows
            ),
            f"Machine: {common.machine_line(info)}. Command: `{common.command_line()}`",
        ]
    )
    out = common.output_dir(args.out, args.quick)
    common.write_json(out / "decode_speed.json", {"machine": info, "settings": settings, "runs": runs})
    (out / "decode_speed.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
