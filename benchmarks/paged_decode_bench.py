"""The native paged decode attention kernel of two commits (or of a commit and the working tree), one
call per layer as a decode step makes them, interleaved in the same run.

Each layer has its own K/V cache (blocks scattered, as a pool hands them out), and between two
layers' calls a sweep over a buffer the size of a layer's weights evicts what the call read, as the
projections between two attention calls do in a real step: the kernel reads its rows from memory
or L3, not from L1/L2 ("cold"). `--warm` leaves the sweep out. Shapes default to the demo model's
(9 heads over 3 KV heads of 64, 30 layers, blocks of 16) and the engine bench's batch-8 contexts
(prompt 32, 32 new tokens: contexts 33..64, every sequence the same length).

Every step is timed for both kernels back to back (order alternating), and each pair gives a
ratio: reported are the median pair ratio of each round, their median and spread, and the ratio of
the fastest steps. Both kernels are checked to agree. `--cpu-time` times the thread's CPU time
(below the kernel's parallel threshold the call runs on the calling thread alone), which leaves
out the time a busy machine takes the core away.

Usage: python benchmarks/paged_decode_bench.py [--before 1bf5250] [--after WORKTREE|COMMIT]
           [--batch-sizes 8] [--contexts 33 48 64] [--rounds 5] [--kv-dtype float32] [--warm] [--cpu-time]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from inference_service.worker.kernels import native_build  # noqa: E402
from inference_service.worker.kernels.attention_bindings import KV_DTYPE_CODES  # noqa: E402
from inference_service.worker.kernels.native_build import F32, I64, POINTER  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"
CSRC_DIRS = ("inference_service/worker/kernels/csrc", "inference_service/worker/csrc")
HEADER_NAMES = ("vec8.h", "kv_types.h", "dequant_row.h")


class Kernel:
    """One commit's paged_decode.cpp, built alone; called through whichever signature it has."""

    def __init__(self, commit: str, scratch: Path):
        self.name = commit
        folder = scratch / commit.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("paged_decode.cpp", *HEADER_NAMES):
            text = _source(commit, name)
            if text is not None:
                (folder / name).write_text(text)
        headers = tuple(folder / name for name in HEADER_NAMES if (folder / name).exists())
        library = ctypes.CDLL(str(native_build.build((folder / "paged_decode.cpp",), headers, stem="paged-bench")))
        self.dtyped = hasattr(library, "paged_decode")
        if self.dtyped:
            self.fn = native_build.bind(library, "paged_decode", [POINTER] * 8 + [I64] * 7 + [F32, I64, F32, I64])
        else:  # before the cache had dtypes: fp32 only
            self.fn = native_build.bind(library, "paged_decode_f32", [POINTER] * 6 + [I64] * 7 + [F32, I64, F32])

    def __call__(self, q, k, v, table, lens, out, block_size: int, scale: float) -> None:
        S, H, D = q.shape
        shape = (S, H, k.shape[1], D, v.shape[2], block_size, table.shape[1], scale, 0, 0.0)
        if self.dtyped:
            status = self.fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), None, None, table.data_ptr(),
                             lens.data_ptr(), out.data_ptr(), *shape, KV_DTYPE_CODES[k.dtype])  # fmt: skip
        else:
            status = self.fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), lens.data_ptr(),
                             out.data_ptr(), *shape)  # fmt: skip
        if status != 0:
            raise RuntimeError(f"{self.name}'s kernel refused the call")


def _source(commit: str, name: str) -> str | None:
    for folder in CSRC_DIRS:
        if commit == WORKTREE:
            path = ROOT / folder / name
            if path.exists():
                return path.read_text()
            continue
        done = subprocess.run(["git", "show", f"{commit}:{folder}/{name}"], cwd=ROOT, capture_output=True, text=True)
        if done.returncode == 0:
            return done.stdout
    return None


class Layers:
    """Per layer: a cache of `num_blocks` scattered blocks; a query batch; a table; an output."""

    def __init__(self, args, batch: int, dtype: torch.dtype, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.block_size = args.block_size
        per_seq = -(-max(args.contexts) // args.block_size)
        num_blocks = batch * per_seq + 4
        self.table = torch.randperm(num_blocks, generator=generator)[: batch * per_seq].view(batch, per_seq)
        slots = num_blocks * args.block_size
        kvh, d = args.num_kv_heads, args.head_dim
        self.caches = [
            tuple(torch.randn(slots, kvh, d, generator=generator).to(dtype) for _ in range(2))
            for _ in range(args.layers)
        ]
        self.q = torch.randn(batch, args.num_heads, d, generator=generator)
        self.out = torch.empty(batch, args.num_heads, d)
        self.scale = d**-0.5
        # One layer's weights of the demo model are ~11 MB (fp32): the bytes a step streams between calls.
        self.sweep = None if args.warm else torch.ones(args.sweep_mb * (1 << 20) // 4)

    def step_ms(self, kernel: Kernel, context: int, clock=time.perf_counter) -> float:
        lens = torch.full((self.q.shape[0],), context, dtype=torch.int64)
        total = 0.0
        for k, v in self.caches:
            if self.sweep is not None:
                self.sweep.add_(1.0)
            start = clock()
            kernel(self.q, k, v, self.table, lens, self.out, self.block_size, self.scale)
            total += clock() - start
        return total * 1e3


def check_agree(before: Kernel, after: Kernel, layers: Layers, context: int) -> float:
    k, v = layers.caches[0]
    lens = torch.full((layers.q.shape[0],), context, dtype=torch.int64)
    outs = []
    for kernel in (before, after):
        kernel(layers.q, k, v, layers.table, lens, layers.out, layers.block_size, layers.scale)
        outs.append(layers.out.clone())
    return float((outs[0] - outs[1]).abs().max())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", default="1bf5250")
    parser.add_argument("--after", default=WORKTREE, help=f"a commit, or {WORKTREE} (the files on disk)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[8])
    parser.add_argument("--contexts", type=int, nargs="+", default=[33, 48, 64])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5, help="steps per context and round (their median counts)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--num-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--sweep-mb", type=int, default=11)
    parser.add_argument("--warm", action="store_true", help="no eviction between layers")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the calling thread's CPU time (a call below the kernel's parallel threshold runs on it alone)",
    )
    parser.add_argument("--num-threads", type=int, help="torch/OpenMP threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = getattr(torch, args.kv_dtype)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    with tempfile.TemporaryDirectory() as scratch:
        before, after = Kernel(args.before, Path(scratch)), Kernel(args.after, Path(scratch))
    if dtype != torch.float32 and not before.dtyped:
        raise SystemExit(f"{args.before}'s kernel reads fp32 caches only")
    print(f"threads {torch.get_num_threads()}, {'warm' if args.warm else 'cold'} cache, {args.kv_dtype} KV")
    for batch in args.batch_sizes:
        layers = Layers(args, batch, dtype)
        print(f"batch {batch}: max |before - after| = {check_agree(before, after, layers, max(args.contexts)):.2e}")
        ratios, best = [], {before.name: float("inf"), after.name: float("inf")}
        for round_index in range(args.rounds):
            pairs = []
            for context in args.contexts:
                for step in range(args.steps):
                    order = (before, after) if (round_index + step) % 2 == 0 else (after, before)
                    ms = {kernel.name: layers.step_ms(kernel, context, clock) for kernel in order}
                    pairs.append(ms[after.name] / ms[before.name])
                    for name, value in ms.items():
                        best[name] = min(best[name], value)
            ratios.append(statistics.median(pairs))
            print(f"  round {round_index + 1}: after/before median of {len(pairs)} paired steps {ratios[-1]:.3f}")
        print(f"batch {batch}: after/before median {statistics.median(ratios):.3f} "
              f"(rounds {min(ratios):.3f}..{max(ratios):.3f}); fastest step (all layers) before "
              f"{best[before.name]:.3f} ms, after {best[after.name]:.3f} ms: "
              f"{best[after.name] / best[before.name]:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
