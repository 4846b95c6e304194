"""What each --kv-cache-dtype costs in quality on the demo model: perplexity on a public-domain text
(`tests/data/alice_chapter1.txt`) and greedy agreement with the fp32 cache, plus KV bytes per token
and the tokens a fixed budget holds.

Both come from the engine itself, as quant_bench.py's do. Prefill runs in chunks of
`--prefill-chunk` tokens (default 64): every chunk after the first attends over the cache, so
perplexity measures attention over the stored (rounded) keys and values for all but the first
chunk's positions; greedy decode reads the cache at every step through the decode kernel.

Usage: python benchmarks/kv_cache_quality.py [--quick] [--kv-dtypes auto fp16 bf16 int8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402
from benchmarks.quant_bench import AGREEMENT_PROMPTS, TEXT, agreement, perplexity, run_all  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

KV_DTYPES = ["auto", "fp16", "bf16", "int8"]
BUDGET = "1GiB"  # the --kv-cache-memory the "tokens held" column is computed for


def build(kv_dtype: str, args: argparse.Namespace):
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from inference_service.engine.builder import build_engine, warm_up

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model_id=args.model_id, device="cpu"),
            cache=CacheConfig(kv_cache_memory=BUDGET, kv_cache_dtype=kv_dtype, prefix_caching=False),
            scheduler=SchedulerConfig(max_batch_prefill_tokens=args.prefill_chunk),
        )
    )
    warm_up(engine)
    return engine


def measure(kv_dtype: str, args: argparse.Namespace, text_ids: list[int], prompts: list[list[int]]) -> dict:
    from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache

    engine = build(kv_dtype, args)
    cache = engine.runner.kv_cache
    shapes = [LayerShape(k.shape[1], k.shape[2]) for k in cache.keys]
    bytes_per_token = PagedKVCache.bytes_per_token(shapes, cache.kv_dtype)
    greedy, _, _, _ = run_all(engine, [common.validated(p, args.agreement_tokens) for p in prompts])
    return {
        "kv_dtype": kv_dtype,
        "stored": str(cache.kv_dtype).removeprefix("torch."),
        "bytes_per_token": bytes_per_token,
        "tokens_held": engine.kv.num_blocks * cache.block_size,
        "ppl": perplexity(engine, text_ids[: args.ppl_tokens]),
        "greedy": greedy,
    }


def report(results: list[dict], args: argparse.Namespace, machine: dict) -> str:
    reference = next(r for r in results if r["kv_dtype"] == "auto")
    rows = [
        [
            f"`{r['kv_dtype']}` ({r['stored']})",
            f"{r['bytes_per_token']:,}",
            f"{r['tokens_held']:,}",
            common.fmt(r["ppl"], 3),
            common.ratio(r["ppl"], reference["ppl"]),
            f"{agreement(r['greedy'], reference['greedy']):.0%}",
        ]
        for r in results
    ]
    table = common.markdown_table(
        ["--kv-cache-dtype", "KV bytes per token", f"tokens in {BUDGET}", "perplexity", "÷ fp32", "greedy = fp32 KV"],
        rows,
    )
    return (
        f"#### KV cache dtypes: {args.model_id}\n\n"
        f"Perplexity: the first {args.ppl_tokens} tokens of `tests/data/alice_chapter1.txt`, prefilled in "
        f"chunks of {args.prefill_chunk} (each later chunk attends over the stored cache). Greedy = fp32 KV: "
        f"share of {args.agreement_tokens} greedy tokens equal to the fp32 cache's before the first "
        f"difference, {len(AGREEMENT_PROMPTS)} prompts. Tokens held: the blocks a {BUDGET} "
        f"--kv-cache-memory holds.\n\n{table}\n\n{common.machine_line(machine)}\n\n`{common.command_line()}`\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help=f"model (default: {DEMO_MODEL_ID}; quick: a tiny random model)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, few tokens")
    parser.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=KV_DTYPES)
    parser.add_argument("--prefill-chunk", type=int, default=64, help="prefill tokens per step (default: 64)")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    if args.model_id is None:
        args.model_id = tiny_model.TINY_MODEL_ID if args.quick else DEMO_MODEL_ID
    args.ppl_tokens, args.agreement_tokens = (128, 8) if args.quick else (1024, 48)
    if "auto" not in args.kv_dtypes:
        args.kv_dtypes = ["auto", *args.kv_dtypes]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.num_threads)
    args.model_id = tiny_model.resolve(args.model_id)
    out = common.output_dir(args.out, args.quick)
    from inference_service.config import ModelConfig
    from inference_service.models.loader import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(ModelConfig(model_id=args.model_id)).path)
    text_ids = tokenizer(TEXT.read_text(encoding="utf-8"))["input_ids"]
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in AGREEMENT_PROMPTS]
    machine = common.machine()
    results = [measure(name, args, text_ids, prompts) for name in tqdm(args.kv_dtypes, desc="KV dtypes")]
    markdown = report(results, args, machine)
    (out / "kv_cache_quality.md").write_text(markdown)
    common.write_json(out / "kv_cache_quality.json", {"args": vars(args), "machine": machine, "results": results})
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
