"""Tensor parallelism (`--num-shard 2`) vs one shard, single stream and a batch, same run.

Both engines serve the same random Llama (SmolLM2-135M's shape with heads that split in two: 12
query heads, 4 KV heads, 768 wide, 12 layers; built locally, since the demo model's 9 heads do not
split over 2 shards) in fp32 on the CPU. The one-shard engine gets every torch thread the shards
get together (`--threads-per-shard` × 2), so the comparison is the same cores used two ways: one
process with two threads, or two processes with one each, adding two all-reduces per layer and a
step message per step. On a 2-core machine no speed-up is expected (near 1×, the cost of the
collectives); tensor parallelism is for a model larger than one device. The shards' collectives
go through shared memory (worker/kernels/shm_collectives.py); a third engine, 2 shards over gloo
alone (`INFERENCE_SERVICE_SHM_COLLECTIVES=off` on shard 0), shows what that saves (`--no-gloo`: skip it).

The fallback runner (transformers' attention, a cache per request: the path of GPT-J, BLOOM, Falcon,
MPT and the encoder-decoders) is measured the same way on a random GPT-J of the same size (12
layers 768 wide, 12 heads, the same vocabulary; `--quick`: a tiny one), 2 shards vs 1, its own rows
(`--no-fallback`: skip it).

Runs alternate between the engines, so machine noise falls on both. Greedy outputs must be equal
(the script checks). Reported: decode ms/token (first token to last, over tokens - 1) and prefill
ms, as medians over the runs, and their ratio (2 shards / 1 shard: under 1 is faster).

Usage: python benchmarks/tensor_parallel_bench.py [--quick] [--runs N] [--batch N] [--no-gloo] [--no-fallback]
                                                  [--no-paged] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402
from inference_service.config import CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from inference_service.engine import shards  # noqa: E402
from inference_service.engine.builder import warm_up  # noqa: E402
from inference_service.engine.llm_engine import LLMEngine  # noqa: E402
from inference_service.worker.kernels import shm_collectives  # noqa: E402

BENCH_DIR = common.RAW_DIR / "tp-llama"
FALLBACK_DIR = common.RAW_DIR / "tp-gptj"
QUICK_FALLBACK_DIR = common.RAW_DIR / "tp-gptj-tiny"
FULL = {"runs": 3, "prompt_tokens": 64, "new_tokens": 32, "batch": 4}
QUICK = {"runs": 1, "prompt_tokens": 16, "new_tokens": 8, "batch": 2}


def ensure_bench_model(folder: Path = BENCH_DIR) -> Path:
    """A random Llama of SmolLM2-135M's size whose heads split in two, with the tiny model's tokenizer."""
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.ensure_tiny_model())
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,  # SmolLM2's: the head and embedding cost what they do there
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    return tiny_model.save_once(folder, LlamaForCausalLM(config), tokenizer)


def ensure_fallback_model(quick: bool) -> Path:
    """A random GPT-J (the fallback runner's: its attention bypasses transformers' interface) of the
    Llama's size, or a tiny one for `--quick`, with the tiny model's tokenizer."""
    folder = QUICK_FALLBACK_DIR if quick else FALLBACK_DIR
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoTokenizer, GPTJConfig, GPTJForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.ensure_tiny_model())
    torch.manual_seed(0)
    size = (
        {"vocab_size": len(tokenizer), "n_embd": 64, "n_layer": 2, "n_head": 4, "rotary_dim": 8}
        if quick
        else {"vocab_size": 49152, "n_embd": 768, "n_layer": 12, "n_head": 12, "rotary_dim": 64}
    )
    special = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    config = GPTJConfig(**size, **special, n_positions=2048, tie_word_embeddings=False)
    return tiny_model.save_once(folder, GPTJForCausalLM(config), tokenizer)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build(model_dir: Path, num_shard: int, threads: int, shared_memory: bool = True) -> LLMEngine:
    """`shared_memory=False`: the shards' collectives over gloo alone (shard 0 decides for all)."""
    config = EngineConfig(
        model=ModelConfig(
            model_id=str(model_dir),
            device="cpu",
            dtype="float32",
            num_threads=threads,
            num_shard=num_shard,
            master_addr="127.0.0.1",
            master_port=free_port(),
        ),
        cache=CacheConfig(max_batch_total_tokens=16384, prefix_caching=False),
    )
    saved = os.environ.get(shm_collectives.ENV_SWITCH)
    os.environ[shm_collectives.ENV_SWITCH] = "on" if shared_memory else "off"
    try:
        engine = shards.build_engine(config)
    finally:
        if saved is None:
            os.environ.pop(shm_collectives.ENV_SWITCH)
        else:
            os.environ[shm_collectives.ENV_SWITCH] = saved
    warm_up(engine)
    return engine


def run_batch(engine: LLMEngine, threads: int, batch: int, args: argparse.Namespace, tag: str) -> dict:
    """`batch` greedy requests together: prefill ms (to every request's first token), decode ms per step."""
    torch.set_num_threads(threads)  # the process-wide setting: this engine's shard 0
    workload = common.make_workload(batch, (args.prompt_tokens,) * 2, (args.new_tokens,) * 2, 300, seed=1)
    started = time.perf_counter()
    for index, prompt in enumerate(workload.prompts):
        engine.add_request(f"{tag}-{index}", common.validated(prompt, args.new_tokens))
    first: float | None = None
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"{output.request_id} failed: {output.error}")
            tokens.setdefault(output.request_id.split("-")[-1], []).extend(t.id for t in output.tokens)
        if first is None and len(tokens) == batch:
            first = time.perf_counter()
    ended = time.perf_counter()
    assert first is not None
    return {
        "prefill_ms": 1000 * (first - started),
        "decode_ms_per_step": 1000 * (ended - first) / (args.new_tokens - 1),
        "tokens": [tokens[str(i)] for i in range(batch)],
    }


def measure(engines: dict[str, tuple[LLMEngine, int]], args: argparse.Namespace) -> dict:
    results: dict[str, dict[str, list[dict]]] = {name: {"single": [], "batch": []} for name in engines}
    for run in range(args.runs):
        order = list(engines) if run % 2 == 0 else list(reversed(engines))
        for workload, batch in (("single", 1), ("batch", args.batch)):
            for name in order:
                engine, threads = engines[name]
                results[name][workload].append(run_batch(engine, threads, batch, args, f"{name}-{workload}-{run}"))
    return results


def summarize(results: dict) -> dict:
    summary: dict = {}
    names = list(results)
    for workload in ("single", "batch"):
        entry: dict = {}
        for name in names:
            rows = results[name][workload]
            entry[name] = {
                "prefill_ms": statistics.median(r["prefill_ms"] for r in rows),
                "decode_ms_per_step": statistics.median(r["decode_ms_per_step"] for r in rows),
            }
        entry["identical"] = all(
            a["tokens"] == b["tokens"]
            for name in names[1:]
            for a, b in zip(results["1 shard"][workload], results[name][workload], strict=True)
        )
        for key in ("prefill_ms", "decode_ms_per_step"):
            entry[f"{key}_ratio"] = entry["2 shards"][key] / entry["1 shard"][key]
            if "2 shards gloo" in entry:
                entry[f"{key}_ratio_gloo"] = entry["2 shards gloo"][key] / entry["1 shard"][key]
        summary[workload] = entry
    return summary


def report(summary: dict, args: argparse.Namespace, name: str, runner: str = "paged runner") -> str:
    gloo = "2 shards gloo" in summary["single"]
    rows = []
    for workload, label in (("single", "1 stream"), ("batch", f"{args.batch} streams")):
        s = summary[workload]
        row = [
            label,
            common.fmt(s["1 shard"]["decode_ms_per_step"], 2),
            common.fmt(s["2 shards"]["decode_ms_per_step"], 2),
            f"**{s['decode_ms_per_step_ratio']:.2f}×**",
        ]
        if gloo:
            row += [
                common.fmt(s["2 shards gloo"]["decode_ms_per_step"], 2),
                f"{s['decode_ms_per_step_ratio_gloo']:.2f}×",
            ]
        row += [
            common.fmt(s["1 shard"]["prefill_ms"]),
            common.fmt(s["2 shards"]["prefill_ms"]),
            f"{s['prefill_ms_ratio']:.2f}×",
        ]
        if gloo:
            row += [common.fmt(s["2 shards gloo"]["prefill_ms"]), f"{s['prefill_ms_ratio_gloo']:.2f}×"]
        rows.append([*row, "yes" if s["identical"] else "NO"])
    header = [
        "workload",
        f"1 shard ({2 * args.threads_per_shard} threads) decode ms/step",
        f"2 shards ({args.threads_per_shard} thread each) decode ms/step",
        "ratio",
    ]
    if gloo:
        header += ["2 shards, gloo only, decode ms/step", "ratio"]
    header += ["1 shard prefill ms", "2 shards prefill ms", "ratio"]
    if gloo:
        header += ["2 shards, gloo only, prefill ms", "ratio"]
    table = common.markdown_table([*header, "same tokens"], rows)
    single = summary["single"]["decode_ms_per_step_ratio"]
    return (
        f"#### Tensor parallel: --num-shard 2 vs 1, {name}, {runner} (float32, cpu)\n\n"
        f"Greedy, {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens; medians of {args.runs} run(s), "
        f"engines alternating. Ratio = 2 shards / 1 shard (under 1× is faster). 2 shards: collectives through "
        f"shared memory; gloo only: over loopback sockets.\n\n{table}\n\n"
        f"**Single-stream decode with 2 shards: {single:.2f}× the time of one shard** (expected near 1× on a "
        f"2-core CPU: the same cores, plus two all-reduces per layer).\n\n"
        f"{common.machine_line(common.machine())}\n\n`{common.command_line()}`\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: the tiny model, one short run")
    parser.add_argument("--model-id", help="a local model folder (default: the random Llama; quick: tiny)")
    parser.add_argument("--runs", type=int)
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--threads-per-shard", type=int, default=1)
    parser.add_argument("--no-gloo", action="store_true", help="skip the 2-shard engine over gloo alone")
    parser.add_argument("--no-fallback", action="store_true", help="skip the fallback runner's engines (GPT-J)")
    parser.add_argument("--no-paged", action="store_true", help="skip the paged runner's engines (Llama)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = common.output_dir(args.out, args.quick)
    threads = args.threads_per_shard
    results: dict = {"args": vars(args)}
    markdown = ""
    if not args.no_paged:
        if args.model_id:
            model_dir, name = Path(args.model_id), args.model_id
        elif args.quick:
            model_dir, name = tiny_model.ensure_tiny_model(), "tiny random Llama"
        else:
            model_dir, name = ensure_bench_model(), "random Llama 12×768, 12/4 heads, 49k vocabulary"
        results["summary"] = compare(model_dir, threads, args, gloo=not args.no_gloo)
        markdown = report(results["summary"], args, name)
    if not args.no_fallback:
        fallback_name = "tiny random GPT-J" if args.quick else "random GPT-J 12×768, 12 heads, 49k vocabulary"
        results["fallback"] = compare(ensure_fallback_model(args.quick), threads, args, gloo=False)
        markdown += "\n" + report(results["fallback"], args, fallback_name, "fallback runner")
    (out / "tensor_parallel.md").write_text(markdown)
    common.write_json(out / "tensor_parallel.json", results)
    print(markdown)
    summaries = [results.get("summary", {}), results.get("fallback", {})]
    return 0 if all(s["identical"] for entry in summaries for s in entry.values()) else 1


def compare(model_dir: Path, threads: int, args: argparse.Namespace, gloo: bool) -> dict:
    """One model's engines (1 shard, 2 shards, and 2 over gloo alone), measured in turn and closed."""
    engines = {"1 shard": (build(model_dir, 1, 2 * threads), 2 * threads)}
    try:
        engines["2 shards"] = (build(model_dir, 2, threads), threads)
        if gloo:
            engines["2 shards gloo"] = (build(model_dir, 2, threads, shared_memory=False), threads)
        return summarize(measure(engines, args))
    finally:
        for engine, _threads in engines.values():
            engine.close()


if __name__ == "__main__":
    sys.exit(main())
