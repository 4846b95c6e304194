"""Two commits' benchmarks in one run: the engine, quantization and speculation scripts of each
commit, run on the same machine one after the other, rounds alternating the order, and their
same-run ratios side by side.

Each commit is exported (`git archive`) to a folder of its own and its own scripts run there, in
child processes with that folder first on the path, so each measures its own code with its own
benchmark. What is compared are the ratios each script takes against a baseline of its own run
(engine ÷ transformers, scheme ÷ CTranslate2 int8 and ÷ fp32, speculative ÷ plain), which hold
when the machine drifts between runs; absolute times are shown but mean less. Round k runs
BEFORE then AFTER when k is odd and the other way round when it is even, so a slow spell does not
always fall on the same commit. Caches under the user's cache folder (demo weights, GGUF
conversions, native kernel builds keyed by their sources, quantized checkpoints) are shared.

Usage: python benchmarks/compare_commits.py BEFORE AFTER [--benches engine quant speculation]
           [--rounds 1] [--quick] [--engine-args "..."] [--quant-args "..."] [--speculation-args "..."]
Writes compare.md and compare.json, and each run's own output and log, under --out
(default benchmarks/results/raw/compare/BEFORE-AFTER).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"engine": "engine_bench.py", "quant": "quant_bench.py", "speculation": "speculation_bench.py"}
RESULTS = {"engine": "engine.json", "quant": "quant.json", "speculation": "speculation.json"}


def export(commit: str, folder: Path) -> str:
    """The commit's tree in `folder` (once); its full hash."""
    sha = _git("rev-parse", "--verify", f"{commit}^{{commit}}").strip()
    tree = folder / sha[:12]
    if not (tree / "benchmarks").is_dir():
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=True)
        tree.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tree, filter="data")
    return sha


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def run_bench(tree: Path, bench: str, out: Path, extra: list[str]) -> float:
    """Runs one benchmark script of `tree` (output and log in `out`); its wall seconds."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    paths = [str(tree), str(tree / "protos"), str(tree / "clients" / "python")]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    command = [sys.executable, str(tree / "benchmarks" / SCRIPTS[bench]), "--out", str(out), *extra]
    started = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        log.write(shlex.join(command) + "\n")
        log.flush()
        done = subprocess.run(command, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{bench} failed in {tree.name} (exit {done.returncode}): see {out / 'log.txt'}")
    return seconds


# -- the ratios of each script's results -----------------------------------------------------------
def engine_ratios(data: dict) -> dict[str, float]:
    """Engine ÷ transformers, and the engine's own tok/s: both commits run the same transformers, so
    where its speed moves between runs (it does, by ±5% on a quiet machine) the ratio moves with it
    and only the engine's own rate tells the commits apart."""
    ratios = {}
    for row in data["results"]:
        engine, hf = row["engine"], row["hf"]
        ratios[f"batch {row['batch_size']} decode ÷ transformers"] = engine["decode_tok_s"] / hf["decode_tok_s"]
        ratios[f"batch {row['batch_size']} prefill ÷ transformers"] = engine["prefill_tok_s"] / hf["prefill_tok_s"]
    for row in data["results"]:
        for phase in ("decode", "prefill"):
            ratios[f"batch {row['batch_size']} {phase} tok/s, engine alone"] = row["engine"][f"{phase}_tok_s"]
    return ratios


def quant_ratios(data: dict) -> dict[str, float]:
    peer, results = data.get("peer"), data["results"]
    fp32 = next(r for r in results if r["scheme"] == "fp32")["throughput_tok_s"]
    ratios = {}
    for r in results:
        if peer:
            ratios[f"{r['scheme']} decode ms ÷ CTranslate2 int8"] = r["decode_ms"]["p50"] / peer["decode_ms"]["p50"]
        ratios[f"{r['scheme']} batch tok/s ÷ fp32"] = r["throughput_tok_s"] / fp32
    if peer:
        ratios["fp32 batch tok/s ÷ CTranslate2 int8"] = fp32 / peer["throughput_tok_s"]
    return ratios


def speculation_ratios(data: dict) -> dict[str, float]:
    return {f"{name} speed-up (speculative ÷ plain)": s["speedup"] for name, s in data["summary"].items()}


RATIOS: dict[str, Callable[[dict], dict[str, float]]] = {
    "engine": engine_ratios,
    "quant": quant_ratios,
    "speculation": speculation_ratios,
}


def summarize(bench: str, runs: dict[str, list[Path]], labels: dict[str, str]) -> tuple[str, dict]:
    """Per ratio: each commit's median over its rounds, and after ÷ before."""
    values: dict[str, dict[str, list[float]]] = {}
    for which, folders in runs.items():
        for folder in folders:
            data = json.loads((folder / RESULTS[bench]).read_text())
            for name, value in RATIOS[bench](data).items():
                values.setdefault(name, {}).setdefault(which, []).append(value)
    rows, summary = [], {}
    for name, by_commit in values.items():
        before, after = (statistics.median(by_commit.get(w, [float("nan")])) for w in ("before", "after"))
        summary[name] = {
            "before": by_commit.get("before", []),
            "after": by_commit.get("after", []),
            "after_over_before": after / before if before else float("nan"),
        }
        rows.append(
            f"| {name} | {before:.2f} ({_listed(by_commit.get('before', []))}) "
            f"| {after:.2f} ({_listed(by_commit.get('after', []))}) | {summary[name]['after_over_before']:.3f} |"
        )
    header = (
        f"#### {bench}: {labels['before']} → {labels['after']}\n\n"
        "| ratio (same run) | before: median (rounds) | after: median (rounds) | after ÷ before |\n"
        "|---|---|---|---|\n"
    )
    return header + "\n".join(rows) + "\n", summary


def _listed(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before", help="commit (hash, branch or tag) measured as the baseline")
    parser.add_argument("after", help="commit compared with it")
    parser.add_argument("--benches", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS))
    parser.add_argument("--rounds", type=int, default=1, help="runs of each benchmark per commit, order alternating")
    parser.add_argument("--quick", action="store_true", help="each script's --quick (a tiny model): a smoke run")
    for bench in SCRIPTS:
        parser.add_argument(f"--{bench}-args", default="", help=f"more arguments for {SCRIPTS[bench]} (one string)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results/raw/compare/BEFORE-AFTER)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trees = ROOT / "benchmarks" / "results" / "raw" / "compare" / "trees"
    shas = {"before": export(args.before, trees), "after": export(args.after, trees)}
    labels = {w: f"{getattr(args, w)} ({shas[w][:7]})" for w in shas}
    out = (  # absolute: each script runs in its commit's folder
        Path(args.out).resolve()
        if args.out
        else ROOT / "benchmarks" / "results" / "raw" / "compare" / (f"{shas['before'][:7]}-{shas['after'][:7]}")
    )
    sections, data, durations = [], {}, []
    for bench in args.benches:
        extra = (["--quick"] if args.quick else []) + shlex.split(getattr(args, f"{bench}_args"))
        runs: dict[str, list[Path]] = {"before": [], "after": []}
        for k in range(1, args.rounds + 1):
            for which in ("before", "after") if k % 2 else ("after", "before"):
                folder = out / bench / f"{which}-{shas[which][:7]}" / f"round{k}"
                print(f"{bench}, round {k}/{args.rounds}: {labels[which]} ...", flush=True)
                seconds = run_bench(trees / shas[which][:12], bench, folder, extra)
                durations.append({"bench": bench, "commit": which, "round": k, "seconds": round(seconds)})
                print(f"  {seconds / 60:.1f} min; output in {folder}", flush=True)
                runs[which].append(folder)
        section, data[bench] = summarize(bench, runs, labels)
        sections.append(section)
    took = ", ".join(f"{d['bench']} {d['commit']} round {d['round']}: {d['seconds'] / 60:.1f} min" for d in durations)
    markdown = "\n".join(sections) + f"\nWall time per run: {took}.\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(markdown)
    (out / "compare.json").write_text(json.dumps({"commits": shas, "ratios": data, "durations": durations}, indent=1))
    print("\n" + markdown + f"\nwritten: {out / 'compare.md'}, {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
