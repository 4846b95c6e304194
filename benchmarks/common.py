"""Helpers the benchmark scripts share: workloads, the engine and its transformers twin, percentile
summaries, a description of the machine, markdown tables and result files.

Every script measures its baselines in the same run as the engine: absolute times on a shared
CPU drift by ±20% between runs, ratios measured side by side do not.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import random
import re
import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
# Per-request and per-step data, and quick runs: ignored by git.
RAW_DIR = RESULTS_DIR / "raw"
QUICK_DIR = RAW_DIR / "quick"
README = ROOT / "benchmarks" / "README.md"


# -- workloads ------------------------------------------------------------------------------------
@dataclasses.dataclass
class Workload:
    """Prompts as token ids and how many tokens each generates (EOS ignored)."""

    prompts: list[list[int]]
    max_new_tokens: list[int]

    @property
    def num_generated(self) -> int:
        return sum(self.max_new_tokens)


def make_workload(
    num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int, seed: int = 0
) -> Workload:
    """Random token prompts (ids from 3 up, clear of the usual special ids) and output lengths."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


def validated(prompt: list[int], max_new_tokens: int):
    """A greedy request that generates exactly `max_new_tokens` (EOS ignored), as the engine takes it."""
    from inference_service.sampling_params import EngineRequest, SamplingParams, StoppingParams

    return EngineRequest(
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
    )


# -- the engine and transformers on the same weights -------------------------------------------
def one_step_prefill_budget(num_prompts: int, prompt_tokens: int) -> int:
    """A step budget that prefills `num_prompts` prompts of `prompt_tokens` in one step, as TGI's
    benchmark does. The budget counts work (engine/step_cost.py: a token deep in a context costs more
    than one), so twice the tokens: enough for prompts shorter than the model's context scale
    (3 × its width in keys, 1,728 for the demo model)."""
    return 2 * num_prompts * prompt_tokens


def load_engine(
    model_id: str, *, max_batch_prefill_tokens: int | None = None, dtype: str = "auto", device: str = "auto"
):
    """A warmed-up `LLMEngine` and its config."""
    from inference_service.config import EngineConfig, ModelConfig, SchedulerConfig
    from inference_service.engine.builder import build_engine, warm_up

    config = EngineConfig(
        model=ModelConfig(model_id=model_id, dtype=dtype, device=device),
        scheduler=SchedulerConfig(max_batch_prefill_tokens=max_batch_prefill_tokens),
    )
    engine = build_engine(config)
    warm_up(engine)
    return engine, config


def load_reference(config, engine):
    """The same checkpoint as a plain transformers model (its default attention), same dtype/device."""
    import torch
    from transformers import AutoModelForCausalLM

    from inference_service.models import loader

    path = loader.resolve_model(config.model).path
    dtype = getattr(torch, engine.info.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(engine.runner.device)
    return model.eval()


# -- statistics -----------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarize(values: Sequence[float]) -> dict[str, float]:
    """avg, min, max, p50, p90, p99 and n, as TGI's benchmark reports them."""
    if not values:
        return {"n": 0, **dict.fromkeys(("avg", "min", "max", "p50", "p90", "p99"), float("nan"))}
    return {
        "n": len(values),
        "avg": float(np.mean(values)),
        "min": float(min(values)),
        "max": float(max(values)),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


# -- describing the run ---------------------------------------------------------------------------
def machine() -> dict[str, str]:
    """CPU, cores, memory and software versions, for the header of every result."""
    import torch
    import transformers

    cpu = platform.processor() or "unknown CPU"
    try:
        text = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.+)", text).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.+)", text).group(1).split()
        cpu += " (" + ", ".join(f for f in ("avx512f", "avx2", "fma") if f in flags) + ")"
    except (OSError, AttributeError):
        pass
    memory = ""
    try:
        kib = int(re.search(r"MemTotal:\s*(\d+)", Path("/proc/meminfo").read_text()).group(1))
        memory = f"{kib / 2**20:.0f} GiB RAM"
    except (OSError, AttributeError):
        pass
    accelerator = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "cpu": cpu,
        "logical_cpus": str(os.cpu_count()),
        "memory": memory,
        "accelerator": accelerator,
        "torch_threads": str(torch.get_num_threads()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_line(info: dict[str, str]) -> str:
    return (
        f"{info['cpu']}, {info['logical_cpus']} logical CPUs, {info['memory']}, accelerator: "
        f"{info['accelerator']}; torch {info['torch']} ({info['torch_threads']} threads), transformers "
        f"{info['transformers']}, Python {info['python']}; {info['date']}"
    )


def command_line(argv: Sequence[str] | None = None) -> str:
    """How this run was started, relative to the repository (for the result's header)."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]).resolve()
    if script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return "python " + shlex.join(argv)


# -- output ---------------------------------------------------------------------------------------
def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float, digits: int = 1) -> str:
    return "–" if value is None or value != value else f"{value:,.{digits}f}"


def ratio(numerator: float, denominator: float) -> str:
    if not denominator or denominator != denominator or numerator != numerator:
        return "–"
    return f"{numerator / denominator:.2f}×"


def output_dir(out: str | None, quick: bool) -> Path:
    """Where results go: the committed folder for full runs, an ignored one for quick runs."""
    folder = Path(out) if out else (QUICK_DIR if quick else RESULTS_DIR)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")


def update_readme(name: str, markdown: str, readme: Path = README) -> bool:
    """Replace the block between `<!-- name:start -->` and `<!-- name:end -->` in the README."""
    if not readme.exists():
        return False
    text = readme.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{markdown.strip()}\n{end}{tail}")
    return True
