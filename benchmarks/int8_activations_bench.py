"""4-bit decode with int8 activations (opt-in: `INFERENCE_SERVICE_QUANT_ACTIVATIONS=int8`) against the
default fp32 activations, on the demo model's own GGUF Q4_1 file, in one process.

- **Speed**: single-stream decode ms/token after a short and a long prompt (engine steps, the prefill
  left out), the two engines' runs alternating so a spell of load on a shared machine hits both alike;
  per engine and prompt the median step of its fastest run counts. Same-run ratio int8 ÷ fp32.
- **Agreement**: greedy continuations of real English prompts (benchmarks/loadgen.py's text) from both
  engines: how many are identical, and the mean number of leading tokens they share.

llama.cpp on the same file is measured by `peer_bench.py` (its `--quant-activations` rows), through
both servers; this script isolates the kernels' effect on one engine step.

    python benchmarks/int8_activations_bench.py             # contexts 32 and 1500, 64 tokens, 3 rounds, 16 prompts
    python benchmarks/int8_activations_bench.py --quick     # a few tokens: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.decode_speed_bench import greedy_stream  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

ENV = "INFERENCE_SERVICE_QUANT_ACTIVATIONS"
FULL = {"tokens": 64, "rounds": 3, "contexts": [32, 1500], "prompts": 16, "agreement_tokens": 64}
QUICK = {"tokens": 8, "rounds": 1, "contexts": [32], "prompts": 2, "agreement_tokens": 8}
KV_TOKENS = 4096


def build(activations: str, model_id: str):
    """An engine on the model's GGUF Q4_1 weights; its linears pick their kernels during the warm-up,
    under the activation format set in the environment for that moment."""
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig
    from inference_service.engine.builder import build_engine, warm_up

    saved = os.environ.get(ENV)
    os.environ[ENV] = activations
    try:
        engine = build_engine(
            EngineConfig(
                model=ModelConfig(model_id=model_id, device="cpu", quantize="gguf"),
                cache=CacheConfig(max_batch_total_tokens=KV_TOKENS, prefix_caching=False),
            )
        )
        warm_up(engine)
    finally:
        if saved is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved
    return engine


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few tokens, one round: checks the script runs")
    parser.add_argument("--contexts", nargs="+", type=int, help="prompt lengths for speed (default: 32 1500)")
    parser.add_argument("--tokens", type=int, help="decode tokens per speed run (default: 64)")
    parser.add_argument("--rounds", type=int, help="alternating rounds (default: 3)")
    parser.add_argument("--prompts", type=int, help="prompts for agreement (default: 16)")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--out", help="folder for int8_activations.json / .md (default: benchmarks/results)")
    args = parser.parse_args(argv)
    settings = dict(QUICK if args.quick else FULL)
    for key in ("contexts", "tokens", "rounds", "prompts"):
        settings[key] = getattr(args, key) or settings[key]
    torch.set_num_threads(args.num_threads)
    engines = {name: build(name, args.model_id) for name in ("fp32", "int8")}
    tokenizer = engines["fp32"].tokenizer
    text = tokenizer("Once upon a time, in a land far away, there lived a")["input_ids"]
    prompts = {length: (text * (length // len(text) + 1))[:length] for length in settings["contexts"]}
    runs: dict[str, dict[int, list[dict]]] = {name: {length: [] for length in prompts} for name in engines}
    for _ in range(settings["rounds"]):
        for length, prompt in prompts.items():
            for name, engine in engines.items():
                runs[name][length].append(common.summarize(greedy_stream(engine, prompt, settings["tokens"])[1]))
    best = {name: {n: min(r, key=lambda run: run["p50"])["p50"] for n, r in per.items()} for name, per in runs.items()}

    from benchmarks.loadgen import Prompts

    texts = Prompts(64, settings["agreement_tokens"], seed=0)
    continuations = {name: [] for name in engines}
    for index in range(settings["prompts"]):
        ids = tokenizer(texts.text(index), add_special_tokens=False)["input_ids"][-64:]
        for name, engine in engines.items():
            continuations[name].append(greedy_stream(engine, ids, settings["agreement_tokens"])[0])
    pairs = list(zip(continuations["fp32"], continuations["int8"], strict=True))
    identical = sum(a == b for a, b in pairs)
    mean_shared = sum(shared_prefix(a, b) for a, b in pairs) / len(pairs)

    speed_rows = []
    for n in prompts:
        fp32, int8 = best["fp32"][n], best["int8"][n]
        speed_rows.append([str(n), common.fmt(fp32, 2), common.fmt(int8, 2), common.ratio(int8, fp32)])
    header = ["prompt tokens", "fp32 activations ms/token", "int8 activations ms/token", "int8 ÷ fp32"]
    info = common.machine()
    markdown = "\n\n".join(
        [
            f"GGUF Q4_1 ({args.model_id}), single-stream decode, {args.num_threads} threads, {settings['tokens']} "
            f"tokens after each prompt, fastest of {settings['rounds']} alternating rounds.",
            common.markdown_table(header, speed_rows),
            f"Greedy agreement over {len(pairs)} prompts of 64 tokens, {settings['agreement_tokens']} new tokens each: "
            f"**{identical}/{len(pairs)}** continuations identical, {mean_shared:.1f} leading tokens shared "
            "on average.",
            f"Machine: {common.machine_line(info)}. Command: `{common.command_line()}`",
        ]
    )
    out = common.output_dir(args.out, args.quick)
    common.write_json(
        out / "int8_activations.json",
        {
            "machine": info,
            "settings": settings,
            "runs": runs,
            "agreement": {"identical": identical, "prompts": len(pairs), "mean_shared_prefix": mean_shared},
            "continuations": continuations,
        },
    )
    (out / "int8_activations.md").write_text(markdown + "\n")
    print(markdown)


if __name__ == "__main__":
    main()
