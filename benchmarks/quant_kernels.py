"""Packed-weight linear kernel vs fp32, per projection shape of the demo model and rows of input.

For each shape (K → N) and row count M: fp32 torch (`F.linear`), the fp32 native few-row kernel
(M ≤ 32), the panel GEMM on fp32 weights, and the packed-weight kernel over int8 per-channel
(gs = K), 4-bit gs 32, 4-bit gs 128 and 8-bit gs 32 codes, plus the many-row path QuantLinear takes
above MAX_QUANT_ROWS (the panel GEMM over the codes) for int8 gs = K and 4-bit gs 32, and what the
engine runs at every row count: fp32 weights and int8 gs = K codes stored in panels (worker/kernels/panels.py).
All variants of one shape and M run in the same rounds, alternating; each number is the median over
rounds of the mean ms per call. The crossover is the smallest M where the panel GEMM beats the kernel.

Usage: python benchmarks/quant_kernels.py [--quick] [--rounds N] [--num-threads T] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import common  # noqa: E402
from inference_service.worker.kernels import bindings as cpu_kernels  # noqa: E402
from inference_service.worker.kernels import panels  # noqa: E402
from inference_service.worker.kernels.packed import quantize_rtn  # noqa: E402

# (name, K, N): the demo model's projections (SmolLM2-135M) and its output head.
SHAPES = [
    ("q/o proj", 576, 576),
    ("k/v proj", 576, 192),
    ("gate/up proj", 576, 1536),
    ("down proj", 1536, 576),
    ("lm head", 576, 49152),
]
QUANTS = [("int8 gs=K", 8, None), ("4-bit gs=32", 4, 32), ("4-bit gs=128", 4, 128), ("8-bit gs=32", 8, 32)]
PANELS = ("int8 gs=K", "4-bit gs=32")  # the codes the many-row path is timed on
FULL = {"rows": [1, 4, 8, 12, 16, 24, 32, 128, 512], "rounds": 5, "min_ms": 40.0, "shapes": [s[0] for s in SHAPES]}
QUICK = {"rows": [1, 4, 32], "rounds": 1, "min_ms": 2.0, "shapes": ["q/o proj", "k/v proj"]}


def time_call(fn, min_ms: float) -> float:
    """Mean ms per call over at least min_ms of calls (one warm-up call first)."""
    fn()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = (time.perf_counter() - start) * 1e3
        if elapsed >= min_ms:
            return elapsed / calls


def variants_for(x: torch.Tensor, weight: torch.Tensor, packed: dict, kernel, linear, panel) -> dict:
    """name → a call computing x [M, K] · W[N, K]ᵀ that way."""
    variants = {"fp32 torch": lambda: F.linear(x, weight)}
    if x.shape[0] <= cpu_kernels.MAX_LINEAR_ROWS:
        variants["fp32 native"] = lambda: linear(x, weight, None)
    variants["fp32 panel"] = lambda: panel(x, weight, None)
    for name, p in packed.items():
        variants[name] = lambda p=p: kernel(x, p, None)
    for name in PANELS:
        variants[f"{name} panel"] = lambda p=packed[name]: panel.quant(x, p, None)
    weight_panels, code_panels = panels.panelled(weight), panels.to_panels(packed["int8 gs=K"])
    variants["fp32 in panels"] = lambda: panel.panels(x, weight_panels, None)
    variants["int8 gs=K in panels"] = lambda: panel.codes(x, *code_panels, None, packed["int8 gs=K"].group_size)
    return variants


def measure_shape(k: int, n: int, args: argparse.Namespace, kernel, linear, panel, progress) -> list[dict]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(k * n))
    packed = {name: quantize_rtn(weight, bits, gs or k, symmetric=gs is None) for name, bits, gs in QUANTS}
    results = []
    for m in args.rows:
        variants = variants_for(torch.randn(m, k), weight, packed, kernel, linear, panel)
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                samples[name].append(time_call(fn, args.min_ms))
            progress.update(1)
        results.append({"k": k, "n": n, "rows": m, "ms": {name: statistics.median(v) for name, v in samples.items()}})
    return results


def crossover(rows: list[dict], codes: str) -> int | None:
    """Smallest M where the panel GEMM over these codes is faster than the kernel (None: never here)."""
    return next((r["rows"] for r in rows if r["ms"][f"{codes} panel"] < r["ms"][codes]), None)


def report(results: list[dict], crossovers: dict[str, int | None], args: argparse.Namespace) -> str:
    names = [
        "fp32 torch",
        "fp32 native",
        "fp32 panel",
        "fp32 in panels",
        *[q[0] for q in QUANTS],
        *[f"{c} panel" for c in PANELS],
        "int8 gs=K in panels",
    ]
    rows = []
    for shape, rows_of_shape in results:
        for r in rows_of_shape:
            base = r["ms"]["fp32 torch"]
            cells = [
                f"{common.fmt(r['ms'][name], 3)} ({common.ratio(base, r['ms'][name])})" if name in r["ms"] else "–"
                for name in names
            ]
            rows.append([f"{shape} {r['k']}→{r['n']}", r["rows"], *cells])
    table = common.markdown_table(["shape K→N", "M", *[f"{name} ms" for name in names]], rows)
    lines = "; ".join(
        f"{codes}: "
        + ", ".join(f"{shape} {'M ≥ ' + str(m) if m else 'none measured'}" for shape, m in by_shape.items())
        for codes, by_shape in crossovers.items()
    )
    return (
        f"#### Quantized linear kernels: ms per call (speed-up vs fp32 torch)\n\n"
        f"x [M, K] · W[N, K]ᵀ; {args.rounds} rounds, all variants alternating, median of each variant's mean "
        f"ms per call (≥ {args.min_ms:g} ms of calls per sample). QuantLinear uses the kernel up to "
        f"MAX_QUANT_ROWS = {cpu_kernels.MAX_QUANT_ROWS} rows (by bits), the panel GEMM above.\n\n{table}\n\n"
        f"Crossover (the panel GEMM faster than the kernel): {lines}.\n\n"
        f"{common.machine_line(common.machine())}\n\n`{common.command_line()}`\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: two small shapes, M 1, 4, 32, one round")
    parser.add_argument("--rows", type=int, nargs="+", help="row counts M")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--min-ms", type=float, help="ms of calls per sample")
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES])
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    kernel, linear = cpu_kernels.load_quant_linear(), cpu_kernels.load_small_batch_linear()
    panel = cpu_kernels.load_panel_linear()
    if kernel is None:
        raise SystemExit("the native kernels did not build (is a C++ compiler installed?)")
    out = common.output_dir(args.out, args.quick)
    shapes = [s for s in SHAPES if s[0] in args.shapes]
    results, crossovers = [], {codes: {} for codes in PANELS}
    with (
        torch.inference_mode(),
        tqdm(total=len(shapes) * len(args.rows) * args.rounds, desc="quant kernels", file=sys.stderr) as progress,
    ):
        for name, k, n in shapes:
            rows = measure_shape(k, n, args, kernel, linear, panel, progress)
            results.append((name, rows))
            for codes in PANELS:
                crossovers[codes][name] = crossover(rows, codes)
    markdown = report(results, crossovers, args)
    (out / "quant_kernels.md").write_text(markdown)
    common.write_json(
        out / "quant_kernels.json",
        {
            "args": vars(args),
            "machine": common.machine(),
            "crossovers": crossovers,
            "results": [{"shape": s, **r} for s, rows in results for r in rows],
        },
    )
    print("\n" + markdown)
    print(f"written: {out / 'quant_kernels.md'}, {out / 'quant_kernels.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
