"""Multi-LoRA serving: many adapters mixed in one batch against the base alone, in the same run.

Three ratios, each measured side by side (runs alternate, best of `--runs`):
- 16 concurrent streams spread over 4 adapters (rank 16, all seven projections) vs the same 16
  streams on a server without adapters: decode throughput (tok/s), goal ≥ 0.85× the base's;
- one stream decoding with an adapter vs the base alone: ms per token, goal ≤ 1.1× (and, to tell the
  adapter's cost from the LoRA server's, one stream without an adapter on the LoRA server: ≈ 1×);
- the 16 mixed streams vs `peft` + transformers generating the same work as one static batch
  (peft's mixed-adapter batches, `adapter_names`; warmed up, timed in each round): tok/s, goal ≥ 3×.
Every request generates exactly `--new-tokens` tokens greedily (EOS ignored). The adapters are made
here with peft (random, non-zero B), in PEFT's on-disk format.

`--thread-modes one,team` also runs the two LoRA measures with the kernel's decode-sized calls held on
one thread (`one`) and/or held on the thread team (`team`; kernels/lora_bindings.py force_threads),
beside its default (several rows on the team, a single row inline): ratios
against the same base runs, printed per round. `--skip-peft` leaves out the peft
comparison (the longest part).

Usage: python benchmarks/lora_bench.py [--quick] [--model-id ID] [--runs N] [--new-tokens N] [--prompt-tokens N]
       [--thread-modes one,team] [--skip-peft]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from inference_service.engine.builder import build_engine, warm_up  # noqa: E402
from inference_service.engine.llm_engine import LLMEngine  # noqa: E402
from inference_service.models import loader  # noqa: E402
from inference_service.worker.kernels.lora_bindings import load_lora_kernel  # noqa: E402
from tests.lora_adapters import make_adapter  # noqa: E402

FULL = {"streams": 16, "adapters": 4, "rank": 16, "prompt_tokens": 64, "new_tokens": 64, "runs": 3}
QUICK = {"streams": 8, "adapters": 4, "rank": 8, "prompt_tokens": 16, "new_tokens": 16, "runs": 1}


def _engine(model_id: str, lora_adapters: str | None) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model_id=model_id, lora_adapters=lora_adapters),
        scheduler=SchedulerConfig(max_batch_prefill_tokens=1024),
    )
    engine = build_engine(config)
    warm_up(engine)
    return engine


def _decode_rate(engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int) -> float:
    """Generated tokens per second over the decode steps (after every prompt is prefilled)."""
    for index, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        request = common.validated(prompt, new_tokens)
        engine.add_request(f"r{index}-{time.monotonic_ns()}", _with_adapter(request, adapter))
    num_tokens, seconds = 0, 0.0
    last: list = []
    engine.step_observer = last.append
    while engine.has_unfinished():
        last.clear()
        outputs = engine.step()
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(str(output.error))
        if last and last[0].num_prefill_requests == 0:  # a decode-only step
            num_tokens, seconds = num_tokens + last[0].num_decode_tokens, seconds + last[0].total_s
    engine.step_observer = None
    return num_tokens / seconds


def _with_adapter(request, adapter: str | None):
    import dataclasses

    return dataclasses.replace(request, adapter_id=adapter)


class PeftBatches:
    """peft + transformers: the whole workload as one static batch, each row with its adapter
    (`adapter_names`). Loaded once and warmed up, then timed each round beside our runs, so both
    sides' best rounds are compared."""

    def __init__(self, path: Path, adapter_dirs: dict[str, Path], prompts, adapters, new_tokens: int) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        names = list(adapter_dirs)
        self.model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(adapter_dirs[name], adapter_name=name)
        self.model.eval()
        self.ids = torch.tensor(prompts)  # every prompt has the same length: no padding
        self.adapter_names = [a or "__base__" for a in adapters]
        self.new_tokens = new_tokens
        self._generate(2)  # first-call costs (allocations, kernel selection) outside the timing

    def _generate(self, new_tokens: int) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.generate(
                input_ids=self.ids,
                attention_mask=torch.ones_like(self.ids),
                adapter_names=self.adapter_names,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )

    def rate(self) -> float:
        started = time.perf_counter()
        out = self._generate(self.new_tokens)
        elapsed = time.perf_counter() - started
        return (out.shape[1] - self.ids.shape[1]) * self.ids.shape[0] / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model-id", default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--thread-modes", default="", help="comma-separated: one, team")
    parser.add_argument("--skip-peft", action="store_true")
    args = parser.parse_args()
    settings = dict(QUICK if args.quick else FULL)
    for key in ("runs", "new_tokens", "prompt_tokens"):
        if getattr(args, key):
            settings[key] = getattr(args, key)
    model_id = tiny_model.resolve(args.model_id or ("tiny" if args.quick else DEMO_MODEL_ID))
    path = loader.resolve_model(ModelConfig(model_id=model_id)).path
    workdir = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter_dirs = {
        f"a{i}": make_adapter(path, workdir / f"a{i}", seed=i, rank=settings["rank"], targets=targets, scale=0.02)
        for i in range(settings["adapters"])
    }
    spec = ",".join(f"{name}={folder}" for name, folder in adapter_dirs.items())
    with_lora, base = _engine(model_id, spec), _engine(model_id, None)
    vocab = base.info.vocab_size
    workload = common.make_workload(
        settings["streams"], (settings["prompt_tokens"],) * 2, (settings["new_tokens"],) * 2, vocab
    )
    names = list(adapter_dirs)
    mixed = [names[i % len(names)] for i in range(settings["streams"])]
    new = settings["new_tokens"]
    rates: dict[str, list[float]] = {"mixed": [], "base": [], "one_adapter": [], "one_base": [], "one_no_adapter": []}
    peft = None if args.skip_peft else PeftBatches(path, adapter_dirs, workload.prompts, mixed, new)
    if peft is not None:
        rates["peft"] = []
    kernel = load_lora_kernel() if args.thread_modes else None
    modes = {"": 0}
    if kernel is not None:
        held = {"one": ("_one_thread", 1), "team": ("_team", 2)}
        modes.update(dict(held[name] for name in args.thread_modes.split(",")))
    for mode in modes:
        rates.update({f"mixed{mode}": [], f"one_adapter{mode}": []} if mode else {})
    for run in range(settings["runs"]):
        for mode, setting in modes.items():
            if kernel is not None:
                kernel.force_threads(setting)
            rates[f"mixed{mode}"].append(_decode_rate(with_lora, workload.prompts, mixed, new))
        rates["base"].append(_decode_rate(base, workload.prompts, [None] * len(mixed), new))
        for mode, setting in modes.items():
            if kernel is not None:
                kernel.force_threads(setting)
            rates[f"one_adapter{mode}"].append(_decode_rate(with_lora, workload.prompts[:1], [names[0]], new))
        rates["one_base"].append(_decode_rate(base, workload.prompts[:1], [None], new))
        rates["one_no_adapter"].append(_decode_rate(with_lora, workload.prompts[:1], [None], new))
        if peft is not None:
            rates["peft"].append(peft.rate())
        print(
            f"round {run + 1}: "
            + ", ".join(
                f"mixed{mode} {rates[f'mixed{mode}'][-1] / rates['base'][-1]:.3f}x tok/s, "
                f"one{mode} {rates['one_base'][-1] / rates[f'one_adapter{mode}'][-1]:.3f}x ms/token"
                for mode in modes
            )
            + (f", mixed vs peft {rates['mixed'][-1] / rates['peft'][-1]:.3f}x tok/s" if peft is not None else ""),
            flush=True,
        )
    best = {key: max(values) for key, values in rates.items()}
    rows = [
        (
            f"{settings['streams']} streams over {len(names)} adapters vs the base alone (tok/s)",
            common.fmt(best["mixed"]),
            common.fmt(best["base"]),
            common.ratio(best["mixed"], best["base"]),
            "≥ 0.85×",
        ),
        (
            "one stream with an adapter vs the base (ms/token)",
            common.fmt(1000 / best["one_adapter"], 2),
            common.fmt(1000 / best["one_base"], 2),
            common.ratio(best["one_base"], best["one_adapter"]),
            "≤ 1.1×",
        ),
        (
            "one stream without an adapter on the LoRA server vs the base (ms/token)",
            common.fmt(1000 / best["one_no_adapter"], 2),
            common.fmt(1000 / best["one_base"], 2),
            common.ratio(best["one_base"], best["one_no_adapter"]),
            "≈ 1×",
        ),
    ]
    for mode in modes:
        if mode:
            rows.append(
                (
                    f"{settings['streams']} streams, LoRA calls held {mode[1:].replace('_', ' ')} (tok/s)",
                    common.fmt(best[f"mixed{mode}"]),
                    common.fmt(best["base"]),
                    common.ratio(best[f"mixed{mode}"], best["base"]),
                    "",
                )
            )
            rows.append(
                (
                    f"one stream, LoRA calls held {mode[1:].replace('_', ' ')} (ms/token)",
                    common.fmt(1000 / best[f"one_adapter{mode}"], 2),
                    common.fmt(1000 / best["one_base"], 2),
                    common.ratio(best["one_base"], best[f"one_adapter{mode}"]),
                    "",
                )
            )
    if peft is not None:
        rows.append(
            (
                f"{settings['streams']} mixed streams vs peft + transformers, one static batch (tok/s)",
                common.fmt(best["mixed"]),
                common.fmt(best["peft"]),
                common.ratio(best["mixed"], best["peft"]),
                "≥ 3×",
            )
        )
    table = common.markdown_table(("measure", "LoRA", "baseline", "ratio", "goal"), rows)
    print(common.machine_line(common.machine()))
    print(f"model {model_id}, rank {settings['rank']}, {settings['prompt_tokens']}-token prompts, {new} new tokens")
    print(table)
    out = common.output_dir(args.out, args.quick)
    common.write_json(out / "lora_bench.json", {"settings": settings, "rates": rates})


if __name__ == "__main__":
    main()
