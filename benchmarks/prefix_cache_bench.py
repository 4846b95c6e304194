"""Prefix caching on a multi-turn chat: time to first token of follow-up turns and throughput, caching
on vs off, in the same run, alternating.

Workload (full): 16 conversations of 6 turns, all opening with the same 1,000-token system prompt.
Each turn asks a short question (about 20 tokens) and generates 16 tokens greedily, EOS ignored, so
both modes do the same work; the reply goes into the history of the next turn, rendered with the
model's chat template. The conversations run concurrently, closed loop: a conversation's next turn
arrives the moment its previous reply is complete. Replies are scaled down from a chat's usual few
hundred tokens to 16 so that a cold-cache run (about 120k prompt tokens to prefill) stays within
minutes on a 2-core CPU; the prompts, which are what prefix caching saves, keep their full size.

Both modes run on one loaded model, each with a fresh engine (a cold cache) and its own KV tensors,
so nothing but the prefix cache differs; their engine steps alternate one for one, and each mode's
times are read on its own clock (the sum of its steps: with a closed loop and no think time an
engine is never idle), so load from other processes on this shared CPU falls on both alike. The
issue's goal: a follow-up turn's TTFT at least 5× faster with caching.

Usage: python benchmarks/prefix_cache_bench.py [--quick] [--model-id ID] [--runs N]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks import common, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID, CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from inference_service.engine.builder import build_engine, warm_up  # noqa: E402
from inference_service.engine.llm_engine import LLMEngine  # noqa: E402
from inference_service.frontend.chat_template import ChatTemplate  # noqa: E402
from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache  # noqa: E402
from inference_service.worker.runner.model_runner import ModelRunner  # noqa: E402

FULL = {"conversations": 16, "turns": 6, "system_tokens": 1000, "tokens_per_turn": 16, "runs": 1}
QUICK = {"conversations": 3, "turns": 3, "system_tokens": 120, "tokens_per_turn": 4, "runs": 1}
KV_TOKENS = 32768  # room for every conversation's whole history: no preemption in either mode
# The tiny model has no chat template: ChatML, as the demo model writes it.
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_VOCABULARY = (
    "bread oven flour yeast dough crust butter sugar salt water morning order cake pastry shop customer "
    "delivery weekend recipe sourdough rye croissant cinnamon almond chocolate fresh warm early late "
    "price open closed holiday special gluten vegan seed oat honey jam coffee tea counter window"
)
_WORDS = _VOCABULARY.split()


@dataclasses.dataclass
class Conversations:
    system: str
    questions: list[list[str]]  # [conversation][turn]


def make_conversations(tokenizer, args: argparse.Namespace) -> Conversations:
    """A system prompt of `system_tokens` tokens (by the model's tokenizer) and short questions."""
    rng = random.Random(0)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < args.system_tokens:
        words += [rng.choice(_WORDS) for _ in range(50)] + ["."]
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[: args.system_tokens]
    system = "You answer questions about a bakery. Facts: " + tokenizer.decode(ids)
    questions = [
        [
            f"Question {turn + 1}: what about the " + " ".join(rng.choice(_WORDS) for _ in range(12)) + "?"
            for turn in range(args.turns)
        ]
        for _ in range(args.conversations)
    ]
    return Conversations(system, questions)


def runners_for(base: LLMEngine) -> dict[str, ModelRunner]:
    """One runner per mode over the same model, each with its own KV tensors, so that the two modes
    can run side by side."""
    kv = base.runner.kv_cache
    shapes = [LayerShape(num_kv_heads=keys.shape[1], head_dim=keys.shape[2]) for keys in kv.keys]
    twin = PagedKVCache(shapes, kv.num_blocks, kv.block_size, kv.keys[0].dtype, base.runner.device)
    return {
        "off": base.runner,
        "on": ModelRunner(base.runner.model, twin, base.runner.device, base.runner.decode_kernel),
    }


class ChatDriver:
    """One mode: a fresh engine (cold cache) and every conversation, closed loop, advanced one engine
    step at a time. Its clock counts only its own steps, so two drivers stepped in turn on one CPU
    share whatever else the machine is doing fairly."""

    def __init__(
        self,
        base: LLMEngine,
        runner: ModelRunner,
        template: ChatTemplate,
        conversations: Conversations,
        prefix_caching: bool,
        args: argparse.Namespace,
        progress: tqdm,
    ):
        info = dataclasses.replace(base.info, prefix_caching=prefix_caching)
        self.engine = LLMEngine(
            info, base.tokenizer, runner, base.sampler, info.max_batch_prefill_tokens, info.max_batch_size
        )
        self.engine.step_observer = lambda stats: self.prefill_tokens.append(stats.num_prefill_tokens)
        self.template, self.conversations, self.args, self.progress = template, conversations, args, progress
        self.prefix_caching = prefix_caching
        self.histories = [[{"role": "system", "content": conversations.system}] for _ in conversations.questions]
        self.clock = 0.0  # seconds spent in this engine's steps
        self.submitted: dict[str, float] = {}
        self.ttft: dict[str, float] = {}
        self.replies: dict[str, list[int]] = {}
        self.prompt_lengths: dict[str, int] = {}
        self.prefill_tokens: list[int] = []
        for conversation in range(len(self.histories)):
            self._submit(conversation, 0)

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def _submit(self, conversation: int, turn: int) -> None:
        history = self.histories[conversation]
        history.append({"role": "user", "content": self.conversations.questions[conversation][turn]})
        prompt = self.engine.tokenizer.encode(self.template.render(history), add_special_tokens=False)
        request_id = f"c{conversation}-t{turn}"
        self.prompt_lengths[request_id] = len(prompt)
        self.submitted[request_id] = self.clock
        self.engine.add_request(request_id, common.validated(prompt, self.args.tokens_per_turn))

    def step(self) -> None:
        started = time.perf_counter()
        outputs = self.engine.step()
        self.clock += time.perf_counter() - started
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"{output.request_id} failed: {output.error}")
            if output.tokens and output.request_id not in self.ttft:
                self.ttft[output.request_id] = self.clock - self.submitted[output.request_id]
            self.replies.setdefault(output.request_id, []).extend(t.id for t in output.tokens)
            if output.finished:
                conversation, turn = (int(part[1:]) for part in output.request_id.split("-"))
                self.histories[conversation].append({"role": "assistant", "content": output.generated_text})
                self.progress.update()
                if turn + 1 < self.args.turns:
                    self._submit(conversation, turn + 1)

    def result(self) -> dict:
        stats = self.engine.stats()
        num_generated = sum(len(tokens) for tokens in self.replies.values())
        return {
            "prefix_caching": self.prefix_caching,
            "engine_s": self.clock,
            "ttft_first_turn_ms": [1000 * v for k, v in self.ttft.items() if k.endswith("-t0")],
            "ttft_follow_up_ms": [1000 * v for k, v in self.ttft.items() if not k.endswith("-t0")],
            "num_generated": num_generated,
            "generated_tok_s": num_generated / self.clock,
            "num_prompt_tokens": sum(self.prompt_lengths.values()),
            "num_prefill_tokens_computed": sum(self.prefill_tokens),
            "hit_rate": stats.prefix_cache_hit_rate,
            "num_steps": stats.num_steps,
            "num_preemptions": stats.num_preemptions,
            "replies": self.replies,
        }


def measure(
    base: LLMEngine, template: ChatTemplate, conversations: Conversations, args: argparse.Namespace
) -> dict[str, list[dict]]:
    """Each run: both modes from a cold cache, their engine steps interleaved one for one."""
    runners = runners_for(base)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    total = args.runs * 2 * args.conversations * args.turns
    with tqdm(total=total, desc="prefix cache bench (turns, both modes)", file=sys.stderr) as progress:
        for _ in range(args.runs):
            drivers = {
                name: ChatDriver(base, runners[name], template, conversations, name == "on", args, progress)
                for name in ("off", "on")
            }
            while not all(driver.done for driver in drivers.values()):
                for driver in drivers.values():
                    if not driver.done:
                        driver.step()
            for name, driver in drivers.items():
                runs[name].append(driver.result())
    return runs


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    for name, results in runs.items():
        summary[name] = {
            "ttft_follow_up_ms": common.summarize([v for r in results for v in r["ttft_follow_up_ms"]]),
            "ttft_first_turn_ms": common.summarize([v for r in results for v in r["ttft_first_turn_ms"]]),
            "generated_tok_s": sum(r["generated_tok_s"] for r in results) / len(results),
            "engine_s": sum(r["engine_s"] for r in results) / len(results),
            "num_prompt_tokens": results[0]["num_prompt_tokens"],
            "num_prefill_tokens_computed": results[0]["num_prefill_tokens_computed"],
            "hit_rate": results[0]["hit_rate"],
            "num_preemptions": sum(r["num_preemptions"] for r in results),
        }
    off, on = summary["off"], summary["on"]
    summary["ratios"] = {
        "ttft_follow_up_mean": off["ttft_follow_up_ms"]["avg"] / on["ttft_follow_up_ms"]["avg"],
        "ttft_follow_up_p50": off["ttft_follow_up_ms"]["p50"] / on["ttft_follow_up_ms"]["p50"],
        "ttft_first_turn_p50": off["ttft_first_turn_ms"]["p50"] / on["ttft_first_turn_ms"]["p50"],
        "throughput": on["generated_tok_s"] / off["generated_tok_s"],
    }
    summary["identical_replies"] = all(r["replies"] == runs["off"][0]["replies"] for rs in runs.values() for r in rs)
    return summary


def report(summary: dict, args: argparse.Namespace, base: LLMEngine) -> str:
    rows = []
    for name in ("off", "on"):
        s = summary[name]
        follow, first = s["ttft_follow_up_ms"], s["ttft_first_turn_ms"]
        rows.append(
            [
                name,
                common.fmt(follow["avg"]),
                common.fmt(follow["p50"]),
                common.fmt(follow["p90"]),
                common.fmt(first["p50"]),
                common.fmt(s["generated_tok_s"]),
                common.fmt(s["engine_s"]),
                f"{s['num_prefill_tokens_computed']:,} / {s['num_prompt_tokens']:,}",
                f"{100 * s['hit_rate']:.1f}%",
            ]
        )
    ratios = summary["ratios"]
    name = "tiny random Llama" if args.model_id == tiny_model.TINY_MODEL_ID else base.info.model_id
    table = common.markdown_table(
        [
            "prefix caching",
            "follow-up TTFT avg ms",
            "p50",
            "p90",
            "first-turn TTFT p50 ms",
            "generated tok/s",
            "engine s",
            "prompt tokens computed / sent",
            "hit rate",
        ],
        rows,
    )
    identical = "identical" if summary["identical_replies"] else "NOT identical"
    return (
        f"#### Prefix caching, multi-turn chat: {name} ({base.info.dtype}, {base.info.device})\n\n"
        f"{args.conversations} conversations × {args.turns} turns, concurrent and closed-loop, sharing a "
        f"{args.system_tokens}-token system prompt; ~20-token questions, {args.tokens_per_turn} tokens generated "
        f"per turn (greedy, EOS ignored); {args.runs} run(s): both modes from a cold cache, their engine steps "
        f"interleaved one for one, times on each engine's own clock (its steps only); KV pool {KV_TOKENS} "
        f"tokens per mode, step budget {base.info.max_batch_prefill_tokens} tokens.\n\n"
        f"{table}\n\n"
        f"**Follow-up TTFT, off ÷ on: {ratios['ttft_follow_up_mean']:.1f}× (mean), "
        f"{ratios['ttft_follow_up_p50']:.1f}× (p50)**; first turn {ratios['ttft_first_turn_p50']:.1f}× (p50); "
        f"throughput on ÷ off {ratios['throughput']:.2f}×. Replies in both modes: {identical}.\n\n"
        f"{common.machine_line(common.machine())}\n\n`{common.command_line()}`\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", help=f"model to load (default: {DEMO_MODEL_ID}; quick: a tiny random model)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 3 conversations of 3 turns")
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--tokens-per-turn", type=int)
    parser.add_argument("--runs", type=int, help="runs (each runs both modes, interleaved)")
    parser.add_argument("--num-threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    if args.model_id is None:
        args.model_id = tiny_model.TINY_MODEL_ID if args.quick else DEMO_MODEL_ID
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.turns < 2 or args.runs < 1 or args.tokens_per_turn < 1:
        parser.error("need --turns >= 2 (follow-ups), --runs >= 1 and --tokens-per-turn >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    out = common.output_dir(args.out, args.quick)
    config = EngineConfig(
        model=ModelConfig(model_id=tiny_model.resolve(args.model_id)),
        cache=CacheConfig(max_batch_total_tokens=KV_TOKENS),
    )
    base = build_engine(config)
    warm_up(base)
    template = ChatTemplate(base.tokenizer, None if getattr(base.tokenizer, "chat_template", None) else CHATML)
    conversations = make_conversations(base.tokenizer, args)
    runs = measure(base, template, conversations, args)
    summary = summarize(runs)
    markdown = report(summary, args, base)
    (out / "prefix_cache.md").write_text(markdown)
    common.write_json(
        out / "prefix_cache.json",
        {
            "args": vars(args),
            "machine": common.machine(),
            "summary": summary,
            "runs": {
                name: [{k: v for k, v in r.items() if k != "replies"} for r in results]
                for name, results in runs.items()
            },
        },
    )
    if out == common.RESULTS_DIR:
        common.update_readme("prefix-cache-results", markdown)
    print("\n" + markdown)
    print(f"written: {out / 'prefix_cache.md'}, {out / 'prefix_cache.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
