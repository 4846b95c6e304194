"""Engine micro-benchmark: TGI's `text-generation-benchmark`, straight against the engine.

For each batch size, a batch of identical-length prompts (fixed lengths, EOS ignored) is prefilled
in one engine step, then decoded step by step until every request has its tokens. Reported per
batch size: prefill latency and per-token decode latency (avg, p50, p90, p99) and tokens/s.

Baselines, interleaved run by run with the engine on the same weights:
- transformers `generate` on a batch of the same size (greedy, same lengths); a logits processor
  timestamps every step, so its prefill and per-token decode latencies are measured the same way;
- the bare-matmul floor: the time to multiply the batch's hidden states by every weight matrix of
  the model once (`F.linear` per weight, lm_head included): B rows for a decode step, B × prompt
  rows for a prefill. Attention, norms, sampling and bookkeeping are what lies above it.

Usage: python benchmarks/engine_bench.py [--quick] [--model-id ID] [--batch-sizes 1 2 4 ...]
Writes engine.md, engine.png and engine.json to benchmarks/results (quick runs: results/raw/quick).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import LogitsProcessor, LogitsProcessorList  # noqa: E402

from benchmarks import common, plots, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

FULL = {"batch_sizes": [1, 2, 4, 8, 16, 32], "prompt_tokens": 32, "decode_tokens": 32, "runs": 5, "warmups": 1}
QUICK = {"batch_sizes": [1, 2, 4], "prompt_tokens": 16, "decode_tokens": 8, "runs": 2, "warmups": 1}


# -- one batch, three ways ------------------------------------------------------------------------
def engine_run(engine, prompts: list[list[int]], decode_tokens: int) -> tuple[float, list[float]]:
    """(prefill seconds, seconds of each decode step) for one batch in an otherwise idle engine."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"bench-{index}", common.validated(prompt, decode_tokens))
    start = time.perf_counter()
    outputs = engine.step()
    prefill = time.perf_counter() - start
    if len(outputs) != len(prompts):
        raise RuntimeError(
            f"the prefill took more than one step ({len(outputs)} of {len(prompts)} first "
            "tokens): raise --max-batch-prefill-tokens"
        )
    steps = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return prefill, steps


class _StepClock(LogitsProcessor):
    """Records when each generation step's logits are ready (transformers calls it once a step)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def transformers_run(model, prompts: list[list[int]], decode_tokens: int, pad_id: int) -> tuple[float, list[float]]:
    """(prefill seconds, seconds of each decode step) of `generate` on the same batch."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])  # [B, S], left padded
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            logits_processor=LogitsProcessorList([clock]),
        )
    # Step k's logits are ready at times[k]: prefill up to times[0], then one decode step per gap.
    return clock.times[0] - start, [b - a for a, b in zip(clock.times, clock.times[1:], strict=False)]


def linear_weights(model) -> list[torch.Tensor]:
    """Every weight matrix a forward pass multiplies by (nn.Linear, the lm_head included)."""
    weights = [module.weight for module in model.modules() if isinstance(module, torch.nn.Linear)]
    if not weights:
        raise RuntimeError("the model has no nn.Linear weights to time")
    return weights


def matmul_floor(weights: list[torch.Tensor], num_rows: int) -> float:
    """Seconds to multiply `num_rows` hidden states by every weight once."""
    inputs = {w.shape[1]: torch.randn(num_rows, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    with torch.inference_mode():
        start = time.perf_counter()
        for weight in weights:
            F.linear(inputs[weight.shape[1]], weight)
        if weights[0].is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


# -- the benchmark --------------------------------------------------------------------------------
def measure(engine, model, args: argparse.Namespace) -> list[dict]:
    """Per batch size: engine, transformers and floor samples, interleaved run by run."""
    weights = linear_weights(model)
    pad_id = engine.info.eos_token_ids[0] if engine.info.eos_token_ids else 0
    results = []
    total = len(args.batch_sizes) * (args.runs + args.warmups)
    with tqdm(total=total, desc="engine bench", unit="run") as bar:
        for batch_size in args.batch_sizes:
            workload = common.make_workload(
                batch_size, (args.prompt_tokens,) * 2, (1, 1), engine.info.vocab_size, seed=batch_size
            )
            samples = {
                key: []
                for key in (
                    "engine_prefill",
                    "engine_steps",
                    "engine_total",
                    "hf_prefill",
                    "hf_steps",
                    "hf_total",
                    "floor_decode",
                    "floor_prefill",
                )
            }
            for run in range(args.warmups + args.runs):
                bar.set_postfix(batch=batch_size)
                engine_prefill, engine_steps = engine_run(engine, workload.prompts, args.decode_tokens)
                hf_prefill, hf_steps = transformers_run(model, workload.prompts, args.decode_tokens, pad_id)
                floor_decode = matmul_floor(weights, batch_size)
                floor_prefill = matmul_floor(weights, batch_size * args.prompt_tokens)
                bar.update()
                if run < args.warmups:
                    continue
                samples["engine_prefill"].append(engine_prefill)
                samples["engine_steps"].extend(engine_steps)
                samples["engine_total"].append(sum(engine_steps))
                samples["hf_prefill"].append(hf_prefill)
                samples["hf_steps"].extend(hf_steps)
                samples["hf_total"].append(sum(hf_steps))
                samples["floor_decode"].append(floor_decode)
                samples["floor_prefill"].append(floor_prefill)
            results.append(summarize(batch_size, args, samples))
    return results


def summarize(batch_size: int, args: argparse.Namespace, samples: dict[str, list[float]]) -> dict:
    """TGI's definitions: prefill tok/s = B × S ÷ latency, decode tok/s = B × steps ÷ total time."""
    num_steps = args.decode_tokens - 1
    row = {"batch_size": batch_size, "prompt_tokens": args.prompt_tokens, "samples": samples}
    for system in ("engine", "hf"):
        row[system] = {
            "prefill_ms": common.summarize([s * 1000 for s in samples[f"{system}_prefill"]]),
            "decode_token_ms": common.summarize([s * 1000 for s in samples[f"{system}_steps"]]),
            "decode_total_ms": common.summarize([s * 1000 for s in samples[f"{system}_total"]]),
            "prefill_tok_s": statistics.mean(batch_size * args.prompt_tokens / s for s in samples[f"{system}_prefill"]),
            "decode_tok_s": statistics.mean(batch_size * num_steps / s for s in samples[f"{system}_total"]),
        }
    row["floor"] = {
        "decode_ms": statistics.median(samples["floor_decode"]) * 1000,
        "prefill_ms": statistics.median(samples["floor_prefill"]) * 1000,
    }
    return row


# -- reporting ------------------------------------------------------------------------------------
def report(results: list[dict], args: argparse.Namespace, engine, plot_name: str) -> str:
    info = engine.info
    header = (
        f"**Model** {model_name(args, engine)} ({info.architecture}, {info.dtype}, {info.device}). **Workload** "
        f"batch sizes {', '.join(map(str, args.batch_sizes))}; prompts of {args.prompt_tokens} random "
        f"tokens; {args.decode_tokens} new tokens each (EOS ignored, greedy): one prefill step, then "
        f"{args.decode_tokens - 1} decode steps; {args.runs} run(s) after {args.warmups} warm-up, the "
        f"engine, transformers and the floor interleaved run by run.\n\n"
        f"**Machine** {common.machine_line(common.machine())}.\n\n"
        f"**Command** `{common.command_line()}`"
    )
    prefill_rows, decode_rows = [], []
    for row in results:
        engine_, hf, floor = row["engine"], row["hf"], row["floor"]
        p, d = engine_["prefill_ms"], engine_["decode_token_ms"]
        prefill_rows.append(
            [
                row["batch_size"],
                common.fmt(p["avg"]),
                common.fmt(p["p50"]),
                common.fmt(p["p90"]),
                common.fmt(p["p99"]),
                common.fmt(engine_["prefill_tok_s"], 0),
                common.fmt(hf["prefill_ms"]["p50"]),
                common.fmt(hf["prefill_tok_s"], 0),
                common.ratio(engine_["prefill_tok_s"], hf["prefill_tok_s"]),
                common.fmt(floor["prefill_ms"]),
                common.ratio(p["p50"], floor["prefill_ms"]),
            ]
        )
        decode_rows.append(
            [
                row["batch_size"],
                common.fmt(d["avg"]),
                common.fmt(d["p50"]),
                common.fmt(d["p90"]),
                common.fmt(d["p99"]),
                common.fmt(engine_["decode_tok_s"], 0),
                common.fmt(hf["decode_token_ms"]["p50"]),
                common.fmt(hf["decode_tok_s"], 0),
                common.ratio(engine_["decode_tok_s"], hf["decode_tok_s"]),
                common.fmt(floor["decode_ms"]),
                common.ratio(d["p50"], floor["decode_ms"]),
            ]
        )
    prefill_table = common.markdown_table(
        [
            "batch",
            "engine avg ms",
            "p50",
            "p90",
            "p99",
            "engine tok/s",
            "transformers p50 ms",
            "transformers tok/s",
            "engine ÷ transformers (tok/s)",
            "matmul floor ms",
            "engine p50 ÷ floor",
        ],
        prefill_rows,
    )
    decode_table = common.markdown_table(
        [
            "batch",
            "engine avg ms/token",
            "p50",
            "p90",
            "p99",
            "engine tok/s",
            "transformers p50 ms/token",
            "transformers tok/s",
            "engine ÷ transformers (tok/s)",
            "matmul floor ms",
            "engine p50 ÷ floor",
        ],
        decode_rows,
    )
    return (
        f"{header}\n\n#### Prefill ({args.prompt_tokens} tokens per sequence, whole batch in one step)\n\n"
        f"{prefill_table}\n\n#### Decode (one step = one token for every sequence of the batch)\n\n"
        f"{decode_table}\n\n![latency vs throughput per batch size]({plot_name})\n"
    )


def model_name(args: argparse.Namespace, engine) -> str:
    return "tiny random Llama" if args.model_id == tiny_model.TINY_MODEL_ID else engine.info.model_id


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model-id",
        help=f"model to load (default: {DEMO_MODEL_ID}; quick: a tiny random model, `{tiny_model.TINY_MODEL_ID}`)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny model, batch sizes 1, 2, 4, short lengths, 2 runs"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (TGI: --sequence-length)")
    parser.add_argument("--decode-tokens", type=int, help="new tokens per sequence, >= 2 (TGI: --decode-length)")
    parser.add_argument("--runs", type=int)
    parser.add_argument("--warmups", type=int)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    if args.model_id is None:
        args.model_id = tiny_model.TINY_MODEL_ID if args.quick else DEMO_MODEL_ID
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be >= 2 (one prefill token, then decode steps)")
    if args.runs < 1 or args.warmups < 0 or args.prompt_tokens < 1 or min(args.batch_sizes) < 1:
        parser.error("need --runs >= 1, --warmups >= 0, --prompt-tokens >= 1 and batch sizes >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    out = common.output_dir(args.out, args.quick)
    prefill_budget = common.one_step_prefill_budget(max(args.batch_sizes), args.prompt_tokens)
    engine, config = common.load_engine(
        tiny_model.resolve(args.model_id), max_batch_prefill_tokens=prefill_budget, dtype=args.dtype, device=args.device
    )
    model = common.load_reference(config, engine)
    results = measure(engine, model, args)

    title = f"{model_name(args, engine)} ({engine.info.dtype}, {engine.info.device})"
    plots.engine_latency_throughput(results, out / "engine.png", title=title)
    markdown = report(results, args, engine, "engine.png")
    (out / "engine.md").write_text(markdown)
    raw = common.RAW_DIR if out == common.RESULTS_DIR else out
    common.write_json(raw / "engine-samples.json", [{"batch_size": r["batch_size"], **r["samples"]} for r in results])
    common.write_json(
        out / "engine.json",
        {
            "args": vars(args),
            "machine": common.machine(),
            "results": [{k: v for k, v in r.items() if k != "samples"} for r in results],
        },
    )
    if out == common.RESULTS_DIR:
        common.update_readme("engine-results", markdown.replace("](engine.png)", "](results/engine.png)"))
    print("\n" + markdown)
    print(f"written: {out / 'engine.md'}, {out / 'engine.png'}, {out / 'engine.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
