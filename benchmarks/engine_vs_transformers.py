"""The engine against transformers, side by side in one process, on the same model and requests.

Workload A: one stream, 32-token prompt, 128 new tokens, greedy: decode ms/token and time to
first token, engine vs `generate`.
Workload B: 64 requests (prompts 16-512 tokens, outputs 16-256, seeded), all submitted at
once: generated tokens/s of the engine vs transformers' static padded batches of 16 in
submission order (left padding), each batch run until its longest request is done.

Lengths are fixed (EOS ignored) so both sides generate exactly the same number of tokens.
Usage: python benchmarks/engine_vs_transformers.py [--model-id ID] [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Workload, load_engine, load_reference, make_workload, validated  # noqa: E402
from inference_service.config import ModelConfig  # noqa: E402
from inference_service.engine.llm_engine import LLMEngine  # noqa: E402


def run_engine(engine: LLMEngine, workload: Workload, progress: str) -> dict:
    """Submit everything at once and step until done; per-request first-token and end times."""
    start = time.perf_counter()
    for index, (prompt, max_new) in enumerate(zip(workload.prompts, workload.max_new_tokens, strict=True)):
        engine.add_request(f"r{index}", validated(prompt, max_new))
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    with tqdm(total=workload.num_generated, desc=progress, unit="tok", leave=False) as bar:
        while engine.has_unfinished():
            for output in engine.step():
                now = time.perf_counter() - start
                first_token.setdefault(output.request_id, now)
                bar.update(len(output.tokens))
                if output.finished:
                    finished[output.request_id] = now
    wall = time.perf_counter() - start
    return {"wall": wall, "first_token": first_token, "finished": finished}


def run_transformers_static(model, workload: Workload, batch_size: int, pad_id: int, progress: str) -> dict:
    """Static batches in submission order; a batch runs until its longest request is done."""
    start = time.perf_counter()
    finished: list[float] = []
    for begin in tqdm(range(0, len(workload.prompts), batch_size), desc=progress, leave=False):
        prompts = workload.prompts[begin : begin + batch_size]
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        max_new = max(workload.max_new_tokens[begin : begin + batch_size])
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
        finished.extend([time.perf_counter() - start] * len(prompts))
    return {"wall": time.perf_counter() - start, "finished": finished}


def single_stream_engine(engine: LLMEngine, prompt: list[int], max_new: int) -> tuple[float, float]:
    """(time to first token, decode ms/token) for one request alone in the engine."""
    run = run_engine(engine, Workload([prompt], [max_new]), "engine A")
    ttft = run["first_token"]["r0"]
    return ttft, (run["finished"]["r0"] - ttft) / (max_new - 1) * 1000


def single_stream_transformers(model, prompt: list[int], max_new: int) -> tuple[float, float]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        total = time.perf_counter() - start
    return ttft, (total - ttft) / (max_new - 1) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-id", default=ModelConfig().model_id)
    parser.add_argument("--quick", action="store_true", help="small workloads, for a smoke run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved repetitions (medians reported)")
    parser.add_argument("--max-batch-prefill-tokens", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    engine, config = load_engine(args.model_id, max_batch_prefill_tokens=args.max_batch_prefill_tokens, device="auto")
    reference = load_reference(config, engine)
    vocab = engine.info.vocab_size
    pad_id = engine.info.eos_token_ids[0] if engine.info.eos_token_ids else 0

    prompt_a = make_workload(1, (32, 32), (1, 1), vocab, seed=1).prompts[0]
    new_a = 16 if args.quick else 128
    workload_b = (
        make_workload(8, (16, 64), (8, 16), vocab) if args.quick else make_workload(64, (16, 512), (16, 256), vocab)
    )

    results: dict[str, list[float]] = {
        key: [] for key in ("engine_ttft", "engine_decode", "hf_ttft", "hf_decode", "engine_b", "hf_b", "engine_p50")
    }
    for _round in range(args.rounds):
        ttft, decode = single_stream_engine(engine, prompt_a, new_a)
        results["engine_ttft"].append(ttft * 1000)
        results["engine_decode"].append(decode)
        ttft, decode = single_stream_transformers(reference, prompt_a, new_a)
        results["hf_ttft"].append(ttft * 1000)
        results["hf_decode"].append(decode)
        run = run_engine(engine, workload_b, "engine B")
        results["engine_b"].append(workload_b.num_generated / run["wall"])
        results["engine_p50"].append(statistics.median(run["finished"].values()))
        run = run_transformers_static(reference, workload_b, 16, pad_id, "transformers B")
        results["hf_b"].append(workload_b.num_generated / run["wall"])

    med = {key: statistics.median(values) for key, values in results.items()}
    print(
        f"\nmodel {engine.info.model_id} ({engine.info.dtype}, {engine.info.device}, "
        f"{torch.get_num_threads()} threads), {args.rounds} round(s), medians\n"
    )
    print("| workload | engine | transformers | engine ÷ transformers |")
    print("|---|---|---|---|")
    print(
        f"| A: decode ms/token (1 stream, {new_a} new) | {med['engine_decode']:.1f} | {med['hf_decode']:.1f} "
        f"| {med['hf_decode'] / med['engine_decode']:.2f}× faster |"
    )
    print(
        f"| A: time to first token, 32-token prompt (ms) | {med['engine_ttft']:.0f} | {med['hf_ttft']:.0f} "
        f"| {med['hf_ttft'] / med['engine_ttft']:.2f}× faster |"
    )
    print(
        f"| B: generated tok/s ({len(workload_b.prompts)} requests; transformers: static batches of 16) "
        f"| {med['engine_b']:.1f} | {med['hf_b']:.1f} | {med['engine_b'] / med['hf_b']:.2f}× |"
    )
    print(f"| B: engine p50 request latency (s) | {med['engine_p50']:.1f} | | |")


if __name__ == "__main__":
    main()
