"""Where a single-stream decode step of the demo model spends its time, fp32 against bf16, in one run.

Each phase's native or torch call is wrapped with a timer (about a microsecond per call, ~300 calls
per step): the projections by shape (fused q|k|v, o, gate|up, down, the head), the glue between them
(norms, rotary + KV write, SiLU·mul), attention, and what is left of the model's forward (Python,
module calls, embedding, rotary tables, final norm); then the rest of the engine's step (scheduler,
sampler). A step whose layers run in one native call (runner/bf16_layers.py, runner/fused_layers.py)
counts them as one phase; `--op-by-op` takes that call away to split them. Each projection's bytes
per token over its time give the bandwidth it streams its weights at. The engines' runs alternate,
and per phase the median over the fastest run's steps counts.

Usage: python benchmarks/decode_phases.py [--dtypes float32 bfloat16] [--tokens 32] [--rounds 2]
                                          [--num-threads 2] [--cpu-time] [--op-by-op]
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

PROMPT = "Once upon a time, in a land far away, there lived a"


class Phases:
    """Time spent per phase during the current step, in ms: wall time, or the process's CPU time
    (on a busy machine, at one thread, that leaves out the time the process waited for a core)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.ms: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def timed(self, name, function, bytes_of=None):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            started = self.clock()
            result = function(*args, **kwargs)
            label = name(*args) if callable(name) else name
            self.ms[label] += 1000 * (self.clock() - started)
            if bytes_of is not None:
                self.bytes[label] += bytes_of(*args)
            return result

        return wrapper


def projection_name(vocab: int, width: int):
    def name(_kernel, _x, weight, _bias=None) -> str:
        n, k = weight.shape[0], weight.shape[-1]
        if n == vocab:
            return "head"
        if k > width:
            return "down"
        return "gate_up" if n > 2 * width else "o" if n == width else "qkv"

    return name


def weight_bytes(_kernel, _x, weight, _bias=None) -> int:
    return weight.numel() * weight.element_size()


def panel_name(vocab: int, width: int):
    """The same names for the panel GEMM's weights [N/32, K, 32]."""
    name = projection_name(vocab, width)
    return lambda kernel, x, panels, bias=None: name(kernel, x, panels.reshape(-1, panels.shape[1]), bias)


def instrument(phases: Phases, vocab: int, width: int) -> None:
    """Wrap the kernels' and the plan's calls (class attributes: every engine's instances)."""
    from inference_service.worker.kernels import bindings
    from inference_service.worker.runner import bf16_layers, decode_step, fused_layers

    name = projection_name(vocab, width)
    for cls in (bindings.SmallBatchLinear, bindings.BF16Linear):
        cls.__call__ = phases.timed(name, cls.__call__, weight_bytes)
    bindings.PanelLinear.panels = phases.timed(panel_name(vocab, width), bindings.PanelLinear.panels, weight_bytes)
    for op in ("add_rms_norm", "rope_kv_write", "silu_mul"):
        setattr(bindings.DecodeGlue, op, phases.timed(op, getattr(bindings.DecodeGlue, op)))
    decode_step.attend_decode = phases.timed("attention", decode_step.attend_decode)
    decode_step.DecodeStep.forward = phases.timed("forward", decode_step.DecodeStep.forward)
    for fused in (bf16_layers.FusedBF16Layers, fused_layers.FusedLayers):
        fused.run = phases.timed("layers in one call", fused.run, lambda fused, *_: fused.weight_bytes)


def build(dtype: str, model_id: str):
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig
    from inference_service.engine.builder import build_engine, warm_up

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(model_id=model_id, device="cpu", dtype=dtype),
            cache=CacheConfig(max_batch_total_tokens=2048, prefix_caching=False),
        )
    )
    warm_up(engine)
    return engine


def run(engine, phases: Phases, prompt: list[int], tokens: int) -> list[dict[str, float]]:
    """Per decode step: ms per phase, and 'step' for the engine's whole step."""
    engine.add_request("bench", common.validated(prompt, tokens))
    steps = []
    produced = 0
    while engine.has_unfinished():
        phases.ms.clear()
        phases.bytes.clear()
        started = phases.clock()
        outputs = engine.step()
        step = dict(phases.ms, step=1000 * (phases.clock() - started))
        if produced:
            steps.append(step | {f"bytes:{k}": v for k, v in phases.bytes.items()})
        produced += sum(len(output.tokens) for output in outputs)
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--cpu-time", action="store_true", help="the process's CPU time instead of wall time")
    parser.add_argument("--op-by-op", action="store_true", help="the decode plan's layers op by op, not in one call")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.num_threads)
    phases = Phases(time.process_time if args.cpu_time else time.perf_counter)
    engines = {dtype: build(dtype, args.model_id) for dtype in args.dtypes}
    for engine in engines.values():
        if args.op_by_op and engine.runner.decode_step is not None:
            engine.runner.decode_step.fused = None
    config = next(iter(engines.values())).runner.model.config
    instrument(phases, config.vocab_size, config.hidden_size)
    prompt = next(iter(engines.values())).tokenizer(PROMPT)["input_ids"]
    best: dict[str, list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for dtype, engine in engines.items():
            steps = run(engine, phases, prompt, args.tokens)
            median_step = statistics.median(s["step"] for s in steps)
            if dtype not in best or median_step < statistics.median(s["step"] for s in best[dtype]):
                best[dtype] = steps
    keys = [
        "layers in one call",
        "qkv",
        "o",
        "gate_up",
        "down",
        "head",
        "add_rms_norm",
        "rope_kv_write",
        "silu_mul",
        "attention",
    ]
    medians = {d: {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys} for d, steps in best.items()}
    for dtype, steps in best.items():
        medians[dtype]["forward, rest"] = statistics.median(s["forward"] for s in steps) - sum(medians[dtype].values())
        medians[dtype]["step, rest"] = statistics.median(s["step"] - s["forward"] for s in steps)
        medians[dtype]["step"] = statistics.median(s["step"] for s in steps)
    first = args.dtypes[0]
    rows = []
    for key in [*keys, "forward, rest", "step, rest", "step"]:
        row = [key]
        for dtype, steps in best.items():
            ms = medians[dtype][key]
            gigabytes = statistics.median(s.get(f"bytes:{key}", 0) for s in steps) / 1e9
            row += [common.fmt(ms, 3), common.fmt(gigabytes / (ms / 1000), 1) if gigabytes and ms > 0 else ""]
        row.append(common.ratio(medians[args.dtypes[-1]][key], medians[first][key]))
        rows.append(row)
    header = ["phase"] + [h for d in args.dtypes for h in (f"{d} ms", f"{d} GB/s")] + [f"{args.dtypes[-1]} ÷ {first}"]
    print(
        f"Decode step phases, {args.model_id}, {args.num_threads} threads, median over the fastest of "
        f"{args.rounds} runs of {args.tokens} tokens each, {'CPU' if args.cpu_time else 'wall'} time.\n\n"
        + common.markdown_table(header, rows)
    )
    print(f"\nMachine: {common.machine_line(common.machine())}. Command: `{common.command_line()}`")


if __name__ == "__main__":
    main()
