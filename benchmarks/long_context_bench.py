"""Decode ms/token against context length (128 → 16k) for each --kv-cache-dtype, on the demo model.

One stream decodes after a context of L tokens. What is timed is the engine's model step
(`ModelRunner.execute`: the decode plan's projections, the KV write, attention over the paged cache,
the head), the median of `--steps` steps per length; scheduling and sampling, the same at every
length, are left out. The context is not prefilled: the sequence's blocks (shuffled through the
pool, as a busy server's are) are written with random rows of the model's K/V magnitude, through
the cache's own conversion. Attention reads every position whatever it holds, so the step costs
what it costs after a real prompt of that length, at a fraction of the prefill time (16k tokens of
prefill per dtype would take minutes here). The demo model states 8k positions; steps beyond that
are timed all the same (the arithmetic does not depend on position).

Baseline in the same run: the torch path (blocks gathered into a padded fp32 copy, then SDPA) on
the fp32 cache, at every length, interleaved length by length with the kernel's rows.

Usage: python benchmarks/long_context_bench.py [--quick] [--kv-dtypes auto fp16 bf16 int8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, plots, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

LENGTHS = [128, 256, 512, 1024, 2048, 4096, 8192, 16384]
QUICK_LENGTHS = [128, 1024]
KV_DTYPES = ["auto", "fp16", "bf16", "int8"]
TORCH_PATH = "torch path, fp32"


def build(kv_dtype: str, args: argparse.Namespace, capacity: int):
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig
    from inference_service.engine.builder import build_engine, warm_up

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model_id=args.model_id, device="cpu"),
            cache=CacheConfig(max_batch_total_tokens=capacity, kv_cache_dtype=kv_dtype, prefix_caching=False),
        )
    )
    warm_up(engine)
    return engine


def fill_context(engine, length: int, seed: int) -> list[int]:
    """A block table for `length` positions (+ the steps), its rows random, blocks shuffled."""
    import torch

    runner, kv = engine.runner, engine.kv
    cache = runner.kv_cache
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(kv.num_blocks, generator=generator)[: -(-length // cache.block_size) + 4].tolist()
    slots = (torch.tensor(table)[:, None] * cache.block_size + torch.arange(cache.block_size)).reshape(-1)[:length]
    for layer in range(len(cache.keys)):
        heads, dim = cache.keys[layer].shape[1:]
        rows = torch.randn(length, heads, dim, generator=generator)
        cache.write(layer, slots, rows * 2.0, rows.roll(1, 0))
    return table


def time_steps(engine, table: list[int], length: int, steps: int) -> float:
    """Median ms of a one-token step at positions length .. length + steps - 1."""
    from inference_service.outputs import ScheduledRequest

    runner = engine.runner
    times = []
    for position in range(length, length + steps):
        started = time.perf_counter()
        runner.execute([ScheduledRequest("long", position, 1, [5], table, True)])
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:] or times)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help=f"model (default: {DEMO_MODEL_ID}; quick: a tiny random model)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, two lengths")
    parser.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=KV_DTYPES)
    parser.add_argument("--lengths", nargs="+", type=int, help=f"context lengths (default: {LENGTHS})")
    parser.add_argument("--steps", type=int, default=9, help="decode steps timed per length (default: 9)")
    parser.add_argument("--num-threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--no-torch-path", action="store_true", help="skip the torch-path baseline")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    if args.model_id is None:
        args.model_id = tiny_model.TINY_MODEL_ID if args.quick else DEMO_MODEL_ID
    args.lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    if args.quick:
        args.steps = min(args.steps, 3)
    return args


def report(rows: dict[str, dict[int, float]], args: argparse.Namespace, machine: dict, plot_name: str) -> str:
    names = list(rows)
    fp32 = rows.get("auto")
    header = ["context", *(f"{name} ms/token" for name in names)]
    if fp32:
        header += [f"{name} ÷ auto" for name in names if name != "auto"]
    table_rows = []
    for length in args.lengths:
        row = [f"{length:,}", *(common.fmt(rows[name][length]) for name in names)]
        if fp32:
            row += [common.ratio(rows[name][length], fp32[length]) for name in names if name != "auto"]
        table_rows.append(row)
    return (
        f"#### Decode ms/token against context length: {args.model_id}, {args.num_threads} threads\n\n"
        f"One stream; the model step only (the median of {args.steps} steps per length, the first of each "
        f"dropped); the context's blocks written with random rows, shuffled through the pool. `auto` is "
        f"the model's dtype (fp32); `{TORCH_PATH}` gathers the blocks into a padded copy and runs SDPA "
        f"(the path without the native kernel).\n\n{common.markdown_table(header, table_rows)}\n\n"
        f"![decode ms/token against context length]({plot_name})\n\n"
        f"{common.machine_line(machine)}\n\n`{common.command_line()}`\n"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from inference_service.worker.kernels import bindings

    torch.set_num_threads(args.num_threads)
    args.model_id = tiny_model.resolve(args.model_id)
    out = common.output_dir(args.out, args.quick)
    machine = common.machine()
    capacity = max(args.lengths) + args.steps + 8 * 16
    rows: dict[str, dict[int, float]] = {}
    for kv_dtype in args.kv_dtypes:
        engine = build(kv_dtype, args, capacity)
        runner = engine.runner
        kernel = runner.decode_kernel
        with_torch_path = kv_dtype == "auto" and not args.no_torch_path
        for length in args.lengths:
            table = fill_context(engine, length, seed=length)
            rows.setdefault(kv_dtype, {})[length] = time_steps(engine, table, length, args.steps)
            if with_torch_path:  # the same cache and table, the kernel taken away
                runner.decode_kernel = None
                rows.setdefault(TORCH_PATH, {})[length] = time_steps(engine, table, length, args.steps)
                runner.decode_kernel = kernel
            timed = ", ".join(f"{name} {values[length]:.1f} ms" for name, values in rows.items() if length in values)
            print(f"{kv_dtype}, context {length}: {timed}", file=sys.stderr)
        del engine, runner
    assert bindings.load_library() is not None, "the native kernels did not build"
    plot_name = "long_context.png"
    plots.lines_against(
        {name: (args.lengths, [values[n] for n in args.lengths]) for name, values in rows.items()},
        out / plot_name,
        title=f"decode ms/token against context, {Path(args.model_id).name}, {args.num_threads} threads",
        xlabel="context length (tokens)",
        ylabel="decode ms/token (model step, median)",
    )
    markdown = report(rows, args, machine, plot_name)
    (out / "long_context.md").write_text(markdown)
    common.write_json(out / "long_context.json", {"args": vars(args), "machine": machine, "ms_per_token": rows})
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
