"""A late prefill chunk's attention against context length: the split path against the masked one.

A prompt of L tokens prefills in chunks of `--chunk` tokens; its last chunk attends the L - chunk
cached tokens before it and itself. Timed per layer at the demo model's attention shape (9 query
heads, 3 KV heads of 64; `--layers` multiplies it into a step), the KV cache in `--kv-dtype`:

- **split** (attention/prefill.py, what the server runs): the prefix whole and the chunk causally,
  two calls of torch's CPU flash attention merged by log-sum-exp; no [chunk, L] matrix.
- **masked** (the baseline, the path before it): one SDPA call over the whole context with a
  boolean [chunk, L] causal mask (SDPA makes a float copy of it per call).

Both read the prefix from the same cache; the median of `--repeats` calls each, interleaved.

    python benchmarks/prefill_attention_bench.py [--contexts 4096 8192 16384] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30  # the demo model (SmolLM2-135M)


def time_context(length: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """Median ms per layer of the last chunk at context `length`, split and masked, and their largest
    difference."""
    import torch

    from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache, resolve_kv_dtype
    from inference_service.worker.attention.prefill import attend_chunk, prefill_mask
    from inference_service.worker.attention.softcap import attend_masked

    computed, n = length - args.chunk, args.chunk
    kv_dtype = resolve_kv_dtype(args.kv_dtype, torch.float32)
    cache = PagedKVCache(
        [LayerShape(KV_HEADS, HEAD_DIM)], -(-length // 16), 16, torch.float32, torch.device("cpu"), kv_dtype
    )
    slots = torch.randperm(cache.num_blocks * 16)[:length]
    cache.write(0, slots, torch.randn(length, KV_HEADS, HEAD_DIM), torch.randn(length, KV_HEADS, HEAD_DIM))
    q = torch.randn(1, HEADS, n, HEAD_DIM)
    k_new, v_new = (torch.randn(1, KV_HEADS, n, HEAD_DIM) for _ in range(2))
    scaling = HEAD_DIM**-0.5

    def split():
        return attend_chunk(q, k_new, v_new, cache, 0, slots, computed, scaling, None, None)

    def masked():
        keys, values = cache.read(0, slots[:computed])  # [P, KVH, D]
        keys = torch.cat([keys.transpose(0, 1).unsqueeze(0), k_new], dim=2)
        values = torch.cat([values.transpose(0, 1).unsqueeze(0), v_new], dim=2)
        mask = prefill_mask(n, computed, None, q.device)  # [n, L]
        return attend_masked(q, keys, values, mask, scaling, None)[0].transpose(0, 1)

    error = (split() - masked()).abs().max().item()
    times: dict[str, list[float]] = {"split": [], "masked": []}
    for _ in range(args.repeats):
        for name, run in (("split", split), ("masked", masked)):
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return 1000 * statistics.median(times["split"]), 1000 * statistics.median(times["masked"]), error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192, 16384])
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default: 2048, the step budget)")
    parser.add_argument("--kv-dtype", default="int8", help="the cache's --kv-cache-dtype (default: int8)")
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"layers per step (default: {LAYERS})")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    rows = []
    for length in args.contexts:
        split_ms, masked_ms, error = time_context(length, args)
        rows.append(
            [
                f"{length:,}",
                common.fmt(split_ms * args.layers, 0),
                common.fmt(masked_ms * args.layers, 0),
                common.ratio(split_ms, masked_ms),
                f"{error:.1e}",
            ]
        )
        print(f"context {length}: split {split_ms:.1f} ms, masked {masked_ms:.1f} ms per layer", file=sys.stderr)
    header = ["context", f"split ms ({args.layers} layers)", "masked ms", "split ÷ masked", "max |difference|"]
    print(
        f"\nLast {args.chunk}-token chunk's attention, {args.kv_dtype} KV, {args.threads} threads\n\n"
        + common.markdown_table(header, rows)
        + f"\n\n{common.machine_line(common.machine())}\n\n`{common.command_line()}`"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
