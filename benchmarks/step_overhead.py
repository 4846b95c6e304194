"""What one decode step of the engine does, counted rather than timed.

Timings on this shared machine drift by ±20%; counts do not. A batch of B greedy requests (EOS
ignored) is prefilled in one step; after a few warm-up decode steps, three passes of `--steps`
decode steps each count, per step:

- GC-tracked objects and memory blocks left alive (the collector off; nothing instrumented);
- Python function calls (cProfile), by function;
- torch calls from Python (`TorchFunctionMode`: `torch.*`, `Tensor` methods and properties), ATen
  ops dispatched (`TorchDispatchMode`), by op and by operands (dtype, shape, strides when not
  contiguous), and native kernel calls (the ctypes functions of `worker/kernels`) with their size
  arguments and pointer alignment.

Run it at two commits on the same model and batch size and diff the two JSON files: what differs
is work one step does that the other does not (`--diff BEFORE.json AFTER.json`). Batch 1 against
batch 8 at one commit shows the per-row work. The model runs on one thread by default.

Usage: python benchmarks/step_overhead.py [--batch-size 8] [--model-id tiny|ID] [--steps 8]
                                          [--top 25] [--json PATH]
       python benchmarks/step_overhead.py --diff BEFORE.json AFTER.json [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import importlib
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_THIS_FILE = Path(__file__).resolve()


class _FunctionCounter(TorchFunctionMode):
    """Counts torch calls made from Python, by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counts[_name(func)] += 1
        return func(*args, **(kwargs or {}))


class _DispatchCounter(TorchDispatchMode):
    """Counts ATen ops as dispatched to the kernels, by overload name, and by name and operands
    (shapes and dtypes: the same ops on larger tensors are more work)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.shaped: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        self.shaped[f"{func}({', '.join(_operand(a) for a in args)})"] += 1
        return func(*args, **(kwargs or {}))


def _operand(value) -> str:
    if isinstance(value, torch.Tensor):  # strides too when not contiguous: the same op may cost more
        layout = "" if value.is_contiguous() else f"/strides{list(value.stride())}"
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}{layout}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_operand(v) for v in value) + "]"
    return type(value).__name__ if value is not None else "None"


class _NativeCalls:
    """Records each call of the native kernels (ctypes functions bound through the kernels'
    `bind`): the function and its size arguments (ints up to 2**31; pointers are larger
    ints, shown by their alignment mod 64 bytes). Installed before the engine is built."""

    def __init__(self):
        self.recording = False
        self.counts: collections.Counter[str] = collections.Counter()
        for module_name, attribute in (
            ("inference_service.worker.kernels.native_build", "bind"),  # the kernels' own modules call it there
            ("inference_service.worker.kernels.bindings", "_bind"),
            ("inference_service.worker.cpu_kernels", "_bind"),  # older commits
        ):
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            bind = getattr(module, attribute, None)
            if bind is not None:
                setattr(module, attribute, self._wrapping(bind))

    def _wrapping(self, bind):
        def wrapped_bind(library, name, argtypes):
            function = bind(library, name, argtypes)

            def call(*args):
                if self.recording:
                    self.counts[f"{name}({', '.join(_native_arg(a) for a in args)})"] += 1
                return function(*args)

            return call

        return wrapped_bind


def _native_arg(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, int) and abs(value) >= 2**31:
        return f"ptr%64={value % 64}"
    return repr(value)


def _name(func) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if name.endswith("__get__"):  # a property (Tensor.shape, .device…): name the property, not its getter
        name = getattr(getattr(func, "__self__", None), "__name__", repr(func))
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{name}" if module and not name.startswith(module) else name


def _calls_by_function(profiler: cProfile.Profile) -> tuple[collections.Counter[str], int]:
    """Calls per function (file:line(name)) and the primitive (non-recursive) total. Summed over
    the profiler's raw entries: `pstats` keys functions by that label and keeps only one of the
    functions sharing it (every dataclass's generated `__init__` is `<string>:2(__init__)`)."""
    calls: collections.Counter[str] = collections.Counter()
    primitive = 0
    for entry in profiler.getstats():
        if not isinstance(entry.code, str) and Path(entry.code.co_filename).resolve() == _THIS_FILE:
            continue  # this script's own wrappers (_NativeCalls)
        calls[_where(entry.code)] += entry.callcount
        primitive += entry.callcount - entry.reccallcount
    return calls, primitive


def _where(code) -> str:
    """file:line(function), the file relative to the repository or to site-packages; builtins by name."""
    if isinstance(code, str):
        return code
    filename = code.co_filename
    if filename.startswith(str(ROOT) + "/"):
        filename = filename[len(str(ROOT)) + 1 :]
    elif "site-packages/" in filename:
        filename = filename.split("site-packages/", 1)[1]
    return f"{filename}:{code.co_firstlineno}({code.co_name})"


def _drain_prefill(engine, batch_size: int, prompt_tokens: int, decode_tokens: int) -> None:
    workload = common.make_workload(batch_size, (prompt_tokens,) * 2, (1, 1), engine.info.vocab_size, seed=batch_size)
    for index, prompt in enumerate(workload.prompts):
        engine.add_request(f"overhead-{index}", common.validated(prompt, decode_tokens))
    outputs = engine.step()
    if len(outputs) != batch_size:
        raise RuntimeError(f"the prefill took more than one step ({len(outputs)} of {batch_size} first tokens)")


def count(engine, native: _NativeCalls, args: argparse.Namespace) -> dict:
    """Counts over `args.steps` decode steps of a batch of `args.batch_size`, divided per step."""
    decode_tokens = 1 + args.warmup_steps + 3 * args.steps + 1  # the batch stays whole through three passes
    _drain_prefill(engine, args.batch_size, args.prompt_tokens, decode_tokens)
    for _ in range(args.warmup_steps):
        engine.step()
    rows = []
    # First pass: GC-tracked objects left alive (gen-0 count with the collector off), and memory
    # blocks left allocated; nothing else is instrumented.
    gc.collect()
    gc.disable()
    blocks, tracked = sys.getallocatedblocks(), gc.get_count()[0]
    for _ in range(args.steps):
        rows.append(len(engine.step()))
    blocks, tracked = sys.getallocatedblocks() - blocks, gc.get_count()[0] - tracked
    gc.enable()
    # Second pass: Python calls (the torch modes of the third would add their own).
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        rows.append(len(engine.step()))
    profiler.disable()
    # Third pass: torch calls, ATen ops and native kernel calls.
    functions, dispatched = _FunctionCounter(), _DispatchCounter()
    native.recording = True
    with functions, dispatched:
        for _ in range(args.steps):
            rows.append(len(engine.step()))
    native.recording = False
    while engine.has_unfinished():
        engine.step()
    if any(r != args.batch_size for r in rows):
        raise RuntimeError(f"a counted step did not decode the whole batch: {rows}")
    calls, primitive_calls = _calls_by_function(profiler)
    per_function = {where: n / args.steps for where, n in calls.most_common()}
    per = args.steps
    return {
        "batch_size": args.batch_size,
        "steps": args.steps,
        "python_calls": sum(calls.values()) / per,
        "python_primitive_calls": primitive_calls / per,
        "torch_calls": sum(functions.counts.values()) / per,
        "aten_ops": sum(dispatched.counts.values()) / per,
        "native_calls": sum(native.counts.values()) / per,
        "objects_kept": tracked / per,
        "blocks_kept": blocks / per,
        "per_function": per_function,
        "per_torch_call": {k: v / per for k, v in functions.counts.most_common()},
        "per_aten_op": {k: v / per for k, v in dispatched.counts.most_common()},
        "per_aten_op_operands": {k: v / per for k, v in dispatched.shaped.most_common()},
        "per_native_call": {k: v / per for k, v in native.counts.most_common()},
    }


def print_counts(result: dict, top: int) -> None:
    print(
        f"batch {result['batch_size']}, per decode step (mean of {result['steps']}): "
        f"{result['python_calls']:.0f} Python calls ({result['python_primitive_calls']:.0f} primitive), "
        f"{result['torch_calls']:.0f} torch calls, {result['aten_ops']:.0f} ATen ops, "
        f"{result['native_calls']:.0f} native kernel calls; {result['objects_kept']:+.1f} GC-tracked objects "
        f"and {result['blocks_kept']:+.1f} memory blocks left alive"
    )
    for title, key in (
        ("Python functions", "per_function"),
        ("torch calls", "per_torch_call"),
        ("ATen ops", "per_aten_op"),
        ("native kernel calls", "per_native_call"),
    ):
        print(f"\ntop {top} {title} (calls per step):")
        for name, calls in list(result[key].items())[:top]:
            print(f"  {calls:8.1f}  {name}")


def print_diff(before: dict, after: dict, top: int) -> None:
    """What changed per step from `before` to `after`, biggest first. Functions are matched by file
    and name, not line, so an edit above a function does not show it as changed."""
    for key in ("python_calls", "torch_calls", "aten_ops", "native_calls", "objects_kept", "blocks_kept"):
        print(f"{key}: {before[key]:.1f} → {after[key]:.1f} ({after[key] - before[key]:+.1f} per step)")
    for key in ("per_native_call", "per_torch_call", "per_aten_op_operands", "per_function"):
        old, new = (_by_name(r[key]) if key == "per_function" else r[key] for r in (before, after))
        changes = {n: new.get(n, 0.0) - old.get(n, 0.0) for n in set(old) | set(new)}
        changes = {n: d for n, d in changes.items() if abs(d) > 1e-9}
        print(f"\n{key}: {len(changes)} changed (showing {min(top, len(changes))}, by size)")
        for name, delta in sorted(changes.items(), key=lambda kv: (-abs(kv[1]), kv[0]))[:top]:
            print(f"  {delta:+8.1f}  ({old.get(name, 0.0):.1f} → {new.get(name, 0.0):.1f})  {name}")


def _by_name(per_function: dict[str, float]) -> dict[str, float]:
    merged: collections.Counter[str] = collections.Counter()
    for where, calls in per_function.items():
        where = re.sub(r" at 0x[0-9a-f]+", "", where)  # a builtin's type object: its address differs per run
        merged[re.sub(r":\d+\((.*)\)$", r":\1", where)] += calls
    return dict(merged)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8, help="decode steps counted")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--model-id", default="tiny", help="'tiny' (default), or a model id / folder")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", help="write every count to this file")
    parser.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --json files and exit")
    args = parser.parse_args(argv)
    if args.diff:
        before, after = (json.loads(Path(p).read_text()) for p in args.diff)
        print_diff(before, after, args.top)
        return 0
    torch.set_num_threads(args.num_threads)
    native = _NativeCalls()
    # Copied into an older commit's tree, whose benchmarks/common.py predates the work budget: tokens.
    budget = getattr(common, "one_step_prefill_budget", lambda prompts, tokens: prompts * tokens)
    engine, _ = common.load_engine(
        tiny_model.resolve(args.model_id),
        max_batch_prefill_tokens=budget(args.batch_size, args.prompt_tokens),
        dtype=args.dtype,
        device=args.device,
    )
    result = count(engine, native, args)
    print_counts(result, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
