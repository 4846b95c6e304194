"""Speculative decoding (`--speculate 4`, prompt lookup) vs plain decoding, single stream, same run.

Two workloads on the demo model's chat template:
- editing: "rewrite this paragraph with one change" over paragraphs of the public-domain text in
  tests/data; the answer repeats most of the prompt (greedy, up to 320 tokens, ends at EOS);
- no repetition: short open questions answered by seeded sampling (temperature 0.8, 128 tokens,
  EOS ignored), where guesses rarely hold.

One loaded model, two engines (plain and --speculate N) each with its own KV tensors and prefix
caching off (a repeated prompt would otherwise skip its prefill in later runs). For every prompt and
run the two modes go one after the other, the order alternating, so machine noise falls on both.
Outputs are identical in both modes (greedy, and seeded sampling: speculation keeps the request's
random stream), so both do the same work; the script checks it. Throughput = generated tokens over
the wall time from the request's arrival to its last token (prefill included), summed per mode.
The issue's goals: editing ≥ 1.8× faster; no repetition at most 5% slower.

Usage: python benchmarks/speculation_bench.py [--quick] [--model-id ID] [--speculate N] [--runs N]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402
from benchmarks.prefix_cache_bench import CHATML, runners_for  # noqa: E402
from inference_service.config import DEMO_MODEL_ID, CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from inference_service.engine.builder import build_engine, warm_up  # noqa: E402
from inference_service.engine.llm_engine import LLMEngine  # noqa: E402
from inference_service.engine.speculation import Speculator  # noqa: E402
from inference_service.frontend.chat_template import ChatTemplate  # noqa: E402
from inference_service.sample.ngram_proposer import NgramProposer  # noqa: E402
from inference_service.sampling_params import EngineRequest, SamplingParams, StoppingParams  # noqa: E402

TEXT = common.ROOT / "tests" / "data" / "alice_chapter1.txt"
FULL = {"edits": 6, "questions": 6, "edit_tokens": 320, "free_tokens": 128, "runs": 2}
QUICK = {"edits": 2, "questions": 2, "edit_tokens": 24, "free_tokens": 16, "runs": 1}
EDITS = [
    ("Alice", "Mary"),
    ("Rabbit", "Cat"),
    ("she", "the girl"),
    ("very", "rather"),
    ("little", "small"),
    ("Alice", "Ann"),
]
QUESTIONS = [
    "Why do cats purr?",
    "Describe a walk in a forest in autumn.",
    "How does a bicycle stay upright?",
    "What makes a good cup of tea?",
    "Tell me about the history of bread.",
    "Why is the sky blue?",
]


@dataclasses.dataclass
class Prompt:
    workload: str  # "editing" or "free"
    token_ids: list[int]
    max_new_tokens: int
    seed: int | None  # None: greedy


def make_prompts(tokenizer, template: ChatTemplate, args: argparse.Namespace) -> list[Prompt]:
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if 300 < len(p) < 1000]
    prompts = []
    for index in range(args.edits):
        old, new = EDITS[index % len(EDITS)]
        paragraph = paragraphs[index % len(paragraphs)]
        message = (
            f'Rewrite the following text, replacing every "{old}" with "{new}". Change nothing else and '
            f"reply with the rewritten text only.\n\n{paragraph}"
        )
        prompts.append(Prompt("editing", _chat(tokenizer, template, message), args.edit_tokens, None))
    for index in range(args.questions):
        prompts.append(
            Prompt(
                "free", _chat(tokenizer, template, QUESTIONS[index % len(QUESTIONS)]), args.free_tokens, 1000 + index
            )
        )
    return prompts


def _chat(tokenizer, template: ChatTemplate, message: str) -> list[int]:
    text = template.render([{"role": "user", "content": message}])
    return tokenizer.encode(text, add_special_tokens=False)


def _request(prompt: Prompt) -> EngineRequest:
    sampling = (
        SamplingParams() if prompt.seed is None else SamplingParams(do_sample=True, seed=prompt.seed, temperature=0.8)
    )
    stopping = StoppingParams(max_new_tokens=prompt.max_new_tokens, ignore_eos=prompt.seed is not None)
    return EngineRequest(prompt_token_ids=list(prompt.token_ids), sampling=sampling, stopping=stopping)


def engines_for(base: LLMEngine, speculate: int) -> dict[str, LLMEngine]:
    runners = runners_for(base)
    info = dataclasses.replace(base.info, prefix_caching=False)
    plain = LLMEngine(
        info, base.tokenizer, runners["off"], base.sampler, info.max_batch_prefill_tokens, info.max_batch_size
    )
    speculator = Speculator(NgramProposer(), speculate, info.max_total_tokens)
    speculative = LLMEngine(
        dataclasses.replace(info, speculate=speculate),
        base.tokenizer,
        runners["on"],
        base.sampler,
        info.max_batch_prefill_tokens,
        info.max_batch_size,
        speculator=speculator,
    )
    return {"plain": plain, "speculative": speculative}


def run_one(engine: LLMEngine, prompt: Prompt, request_id: str) -> dict:
    drafts, accepted = engine.num_draft_tokens, engine.num_accepted_tokens
    steps = engine.num_steps
    started = time.perf_counter()
    engine.add_request(request_id, _request(prompt))
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.error is not None:
                raise RuntimeError(f"{request_id} failed: {output.error}")
            tokens += [t.id for t in output.tokens]
    return {
        "seconds": time.perf_counter() - started,
        "tokens": tokens,
        "steps": engine.num_steps - steps,
        "drafts": engine.num_draft_tokens - drafts,
        "accepted": engine.num_accepted_tokens - accepted,
    }


def measure(engines: dict[str, LLMEngine], prompts: list[Prompt], args: argparse.Namespace) -> list[dict]:
    results = []
    with tqdm(total=args.runs * len(prompts) * 2, desc="speculation bench (requests)", file=sys.stderr) as progress:
        for run in range(args.runs):
            for index, prompt in enumerate(prompts):
                order = ["plain", "speculative"] if (run + index) % 2 == 0 else ["speculative", "plain"]
                row = {"workload": prompt.workload, "prompt_tokens": len(prompt.token_ids), "run": run}
                for mode in order:
                    row[mode] = run_one(engines[mode], prompt, f"{mode}-{run}-{index}")
                    progress.update()
                results.append(row)
    return results


def summarize(results: list[dict]) -> dict:
    summary = {}
    for workload in ("editing", "free"):
        rows = [r for r in results if r["workload"] == workload]
        entry = {"identical": all(r["plain"]["tokens"] == r["speculative"]["tokens"] for r in rows)}
        for mode in ("plain", "speculative"):
            seconds = sum(r[mode]["seconds"] for r in rows)
            tokens = sum(len(r[mode]["tokens"]) for r in rows)
            entry[mode] = {
                "tok_s": tokens / seconds,
                "ms_per_token": 1000 * seconds / tokens,
                "tokens": tokens,
                "tokens_per_step": tokens / sum(r[mode]["steps"] for r in rows),
            }
        drafts = sum(r["speculative"]["drafts"] for r in rows)
        entry["acceptance_rate"] = sum(r["speculative"]["accepted"] for r in rows) / drafts if drafts else 0.0
        entry["speedup"] = entry["speculative"]["tok_s"] / entry["plain"]["tok_s"]
        summary[workload] = entry
    return summary


def report(summary: dict, args: argparse.Namespace, base: LLMEngine) -> str:
    rows = []
    for workload, label in (("editing", "editing (answer repeats the prompt)"), ("free", "no repetition")):
        s = summary[workload]
        rows.append(
            [
                label,
                common.fmt(s["plain"]["tok_s"]),
                common.fmt(s["speculative"]["tok_s"]),
                f"**{s['speedup']:.2f}×**",
                f"{100 * s['acceptance_rate']:.0f}%",
                f"{s['speculative']['tokens_per_step']:.2f}",
                "yes" if s["identical"] else "NO",
            ]
        )
    name = "tiny random Llama" if args.model_id == tiny_model.TINY_MODEL_ID else base.info.model_id
    table = common.markdown_table(
        [
            "workload",
            "plain tok/s",
            f"--speculate {args.speculate} tok/s",
            "speed-up",
            "guesses accepted",
            "tokens per step",
            "same tokens",
        ],
        rows,
    )
    edit, free = summary["editing"]["speedup"], summary["free"]["speedup"]
    return (
        f"#### Speculative decoding, single stream: {name} ({base.info.dtype}, {base.info.device})\n\n"
        f"Editing: {args.edits} paragraphs rewritten with one word replaced (greedy, ≤ {args.edit_tokens} "
        f"tokens, EOS ends it); no repetition: {args.questions} open questions, seeded sampling at temperature "
        f"0.8, {args.free_tokens} tokens. {args.runs} run(s), modes alternating per prompt; tokens/s include "
        f"the prefill.\n\n{table}\n\n"
        f"**Editing {edit:.2f}× faster (goal ≥ 1.8×: {'met' if edit >= 1.8 else 'NOT met'}); no repetition "
        f"{edit_word(free)} (goal ≤ 5% slower: {'met' if free >= 0.95 else 'NOT met'}).**\n\n"
        f"{common.machine_line(common.machine())}\n\n`{common.command_line()}`\n"
    )


def edit_word(ratio: float) -> str:
    return f"{100 * (1 - ratio):.1f}% slower" if ratio < 1 else f"{100 * (ratio - 1):.1f}% faster"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help=f"model to load (default: {DEMO_MODEL_ID}; quick: a tiny random model)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, two prompts per workload")
    parser.add_argument("--speculate", type=int, default=4)
    parser.add_argument("--edits", type=int)
    parser.add_argument("--questions", type=int)
    parser.add_argument("--edit-tokens", type=int)
    parser.add_argument("--free-tokens", type=int)
    parser.add_argument("--runs", type=int)
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    if args.model_id is None:
        args.model_id = tiny_model.TINY_MODEL_ID if args.quick else DEMO_MODEL_ID
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    out = common.output_dir(args.out, args.quick)
    config = EngineConfig(
        model=ModelConfig(model_id=tiny_model.resolve(args.model_id)),
        cache=CacheConfig(max_batch_total_tokens=8192, prefix_caching=False),
    )
    base = build_engine(config)
    warm_up(base)
    template = ChatTemplate(base.tokenizer, None if getattr(base.tokenizer, "chat_template", None) else CHATML)
    engines = engines_for(base, args.speculate)
    results = measure(engines, make_prompts(base.tokenizer, template, args), args)
    summary = summarize(results)
    markdown = report(summary, args, base)
    (out / "speculation.md").write_text(markdown)
    common.write_json(
        out / "speculation.json",
        {
            "args": vars(args),
            "machine": common.machine(),
            "summary": summary,
            "requests": [
                {
                    k: ({m: v for m, v in val.items() if m != "tokens"} if isinstance(val, dict) else val)
                    for k, val in r.items()
                }
                for r in results
            ],
        },
    )
    if out == common.RESULTS_DIR:
        common.update_readme("speculation-results", markdown)
    print("\n" + markdown)
    print(f"written: {out / 'speculation.md'}, {out / 'speculation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
