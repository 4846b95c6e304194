"""What the engine-core process costs: `launch` with `--engine-core-process true` against `false`,
in one run, alternating the order each round, as same-run ratios (split ÷ in-process).

Per round and layout: seconds from the command to "ready"; one gRPC stream's milliseconds per token;
the tokens per second of `--streams` concurrent streams. Ratios near 1.00 mean the split is free.

    python benchmarks/engine_core_overhead.py                      # the tiny model, ~2 min
    python benchmarks/engine_core_overhead.py --model-id <id> --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from benchmarks import tiny_model  # noqa: E402
from benchmarks.launched import LaunchedServer  # noqa: E402
from textgen.v1 import generate_pb2 as pb  # noqa: E402
from textgen.v1 import generate_pb2_grpc  # noqa: E402


def stream_tokens(target: str, max_new_tokens: int, out: list[tuple[int, float]], seed: int) -> None:
    """One GenerateStream; appends (tokens, seconds from the first token to the last)."""
    request = pb.GenerateRequest(
        inputs=f"the quick brown fox {seed}",
        parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens),
    )
    with grpc.insecure_channel(target) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        first = last = 0.0
        count = 0
        for _ in stub.GenerateStream(request, timeout=600):
            last = time.perf_counter()
            first = first or last
            count += 1
    out.append((count, last - first))


def measure(model_id: str, split: bool, streams: int, max_new_tokens: int, workdir: Path) -> dict[str, float]:
    started = time.perf_counter()
    args = ["--engine-core-process", str(split).lower(), "--max-total-tokens", "1024", "--prometheus-port", "0"]
    with LaunchedServer(model_id, args, workdir / f"launch-{split}.log") as server:
        ready_s = time.perf_counter() - started
        stream_tokens(server.grpc_target, 8, [], 0)  # warm
        one: list[tuple[int, float]] = []
        stream_tokens(server.grpc_target, max_new_tokens, one, 1)
        many: list[tuple[int, float]] = []
        threads = [
            threading.Thread(target=stream_tokens, args=(server.grpc_target, max_new_tokens, many, i))
            for i in range(streams)
        ]
        begun = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - begun
    tokens, seconds = one[0]
    return {
        "ready_s": ready_s,
        "ms_per_token": 1000 * seconds / max(tokens - 1, 1),
        "tokens_per_s": sum(count for count, _ in many) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=tiny_model.TINY_MODEL_ID, help="a model id, or `tiny`")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    options = parser.parse_args()
    model_id = tiny_model.resolve(options.model_id)
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="engine-core-bench-") as workdir:
        for round_index in range(options.rounds):
            order = (True, False) if round_index % 2 == 0 else (False, True)
            for split in order:
                result = measure(model_id, split, options.streams, options.max_new_tokens, Path(workdir))
                results[split].append(result)
                print(f"round {round_index + 1} {'split' if split else 'in-process'}: {result}", flush=True)
    print(f"\n| metric (median of {options.rounds}) | in-process | split | split ÷ in-process |")
    print("|---|---|---|---|")
    for key in ("ready_s", "ms_per_token", "tokens_per_s"):
        apart = statistics.median(r[key] for r in results[True])
        here = statistics.median(r[key] for r in results[False])
        print(f"| {key} | {here:.3f} | {apart:.3f} | {apart / here:.2f} |")


if __name__ == "__main__":
    main()
