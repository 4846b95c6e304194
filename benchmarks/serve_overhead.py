"""What the server adds to one stream's decode: the engine stepped in-process against the same engine
behind `launch` (gRPC, front end, engine-core process), in one run, alternating each round.

- **in-process**: an `LLMEngine` stepped in this process; ms/token = its median decode step.
- **split** (`--engine-core-process true`, the default) and **one-process** (`false`): one gRPC
  `GenerateStream` with a prompt of exactly `--contexts` tokens; ms/token = the median gap between
  two tokens as the client sees them. Beside it, the server's own mean decode step
  (`tgi_batch_inference_duration`, read off /metrics before and after the stream): the gap minus
  the step is what lies between steps (IPC, delivery, the step loop); the step minus the in-process
  step is what the server's other threads and processes cost the step itself.
- **CPU ms per decode token** of the engine (the core process; in-process: this process) and of the
  API process (one-process: both in it), from a short and a long stream's difference: what a
  busy machine's clock hides (OpenMP threads spinning count too).
- `--server-env NAME=VALUE` adds a row: the split server with that variable set. An A/B of, say,
  libgomp's `GOMP_SPINCOUNT`: how long the core's OpenMP threads spin after a parallel op before
  they sleep, while the API process needs a core for each token.

Ratios near 1.00 mean the server is free. Same flags as `peer_bench.py`'s rows (2 threads, prefix
caching off, fp16 KV, `--quantize gguf` for q4_1).

    python benchmarks/serve_overhead.py                         # demo model, q4_1 and f32, context 128
    python benchmarks/serve_overhead.py --formats q4_1 --contexts 128 512 --rounds 3 --layouts split
    python benchmarks/serve_overhead.py --formats q4_1 --layouts split --server-env GOMP_SPINCOUNT=20000
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import resource
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import torch  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.decode_speed_bench import greedy_stream  # noqa: E402
from benchmarks.launched import LaunchedServer  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402
from textgen.v1 import generate_pb2 as pb  # noqa: E402
from textgen.v1 import generate_pb2_grpc  # noqa: E402

THREADS = 2
SHORT_TOKENS = 8  # the stream whose CPU is taken off a long one's
LAYOUTS = {"split": "true", "one-process": "false"}
TEXT = "Once upon a time, in a land far away, there lived a"


def engine_args(fmt: str, longest: int, new_tokens: int, threads: int = THREADS) -> list[str]:
    args = ["--num-threads", str(threads), "--prefix-caching", "false", "--kv-cache-dtype", "fp16"]
    args += ["--max-total-tokens", str(longest + new_tokens), "--max-input-tokens", str(longest)]
    args += ["--max-batch-total-tokens", str(4 * (longest + new_tokens))]
    return args + (["--quantize", "gguf"] if fmt == "q4_1" else [])


def build_engine(model_id: str, fmt: str, longest: int, new_tokens: int, threads: int):
    from inference_service.config import CacheConfig, EngineConfig, ModelConfig
    from inference_service.engine.builder import build_engine, warm_up

    engine = build_engine(
        EngineConfig(
            model=ModelConfig(
                model_id=model_id, device="cpu", num_threads=threads, quantize="gguf" if fmt == "q4_1" else None
            ),
            cache=CacheConfig(
                max_batch_total_tokens=4 * (longest + new_tokens), prefix_caching=False, kv_cache_dtype="fp16"
            ),
        )
    )
    warm_up(engine)
    return engine


def prompt_ids(tokenizer, length: int) -> list[int]:
    text = tokenizer(TEXT)["input_ids"]
    return (text * (length // len(text) + 1))[:length]


def in_process(engine, length: int, new_tokens: int) -> dict[str, float]:
    prompt = prompt_ids(engine.tokenizer, length)
    short_cpu = _own_cpu_ms()
    greedy_stream(engine, prompt, SHORT_TOKENS)
    long_cpu = _own_cpu_ms()
    _, steps = greedy_stream(engine, prompt, new_tokens)
    cpu = (_own_cpu_ms() - long_cpu - (long_cpu - short_cpu)) / (new_tokens - SHORT_TOKENS)
    return {"ms_per_token": statistics.median(steps), "step_ms": statistics.median(steps), "core_cpu": cpu}


def _own_cpu_ms() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return 1000 * (usage.ru_utime + usage.ru_stime)


def _cpu_ms(pid: int) -> float:
    """CPU milliseconds a process's threads have run (schedstat: nanoseconds, not clock ticks)."""
    total = 0
    for thread in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            total += int(Path(f"/proc/{pid}/task/{thread}/schedstat").read_text().split()[0])
    return total / 1e6


def _core_pid(server: LaunchedServer) -> int | None:
    """The engine-core process of a launched server (None: the engine runs in the API process)."""
    pid = server.process.pid
    for thread in os.listdir(f"/proc/{pid}/task"):
        for child in Path(f"/proc/{pid}/task/{thread}/children").read_text().split():
            if b"envoy" not in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    return None


_METRIC = re.compile(r'^tgi_batch_inference_duration_(sum|count)\{[^}]*method="decode"[^}]*\} (\S+)$', re.M)


def decode_steps(rest_url: str) -> tuple[float, float]:
    """(seconds, count) of the server's decode steps so far."""
    with urllib.request.urlopen(rest_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {kind: float(value) for kind, value in _METRIC.findall(text)}
    return values.get("sum", 0.0), values.get("count", 0.0)


def stream_gaps(target: str, length: int, new_tokens: int) -> list[float]:
    """One GenerateStream of a `length`-token prompt; the ms between consecutive tokens."""
    text = (TEXT + " ") * (length // 4 + 8)
    request = pb.GenerateRequest(
        inputs=text, parameters=pb.GenerateParameters(max_new_tokens=new_tokens, truncate=length)
    )
    arrivals = []
    with grpc.insecure_channel(target) as channel:
        for _ in generate_pb2_grpc.TextGenerationStub(channel).GenerateStream(request, timeout=600):
            arrivals.append(time.perf_counter())
    return [1000 * (b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]


def served(server: LaunchedServer, length: int, new_tokens: int) -> dict[str, float]:
    """The client's gaps, the server's steps, and the CPU each process spent per decode token: a
    stream of SHORT_TOKENS then one of `new_tokens`, the difference over the tokens between (the
    prefill and the request's setup cancel out; CPU time holds where a busy machine's clock does not)."""
    pids = {"api_cpu": server.process.pid, "core_cpu": _core_pid(server)}
    cpu = {key: _cpu_ms(pid) for key, pid in pids.items() if pid is not None}
    stream_gaps(server.grpc_target, length, SHORT_TOKENS)
    middle = {key: _cpu_ms(pid) for key, pid in pids.items() if pid is not None}
    before = decode_steps(server.rest_url)
    gaps = stream_gaps(server.grpc_target, length, new_tokens)
    after = decode_steps(server.rest_url)
    end = {key: _cpu_ms(pid) for key, pid in pids.items() if pid is not None}
    steps = max(after[1] - before[1], 1)
    tokens = len(gaps) + 1
    per_token = {key: (end[key] - 2 * middle[key] + cpu[key]) / (tokens - SHORT_TOKENS) for key in cpu}
    return {
        "ms_per_token": statistics.median(gaps),
        "step_ms": 1000 * (after[0] - before[0]) / steps,
        "tokens": tokens,
        **per_token,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--formats", nargs="+", choices=["q4_1", "f32"], default=["q4_1", "f32"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[128])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--threads", type=int, default=THREADS, help="torch threads (1: no OpenMP spin in the CPU columns)"
    )
    parser.add_argument("--server-env", action="append", default=[], help="NAME=VALUE: a split row with it set")
    args = parser.parse_args(argv)
    threads = args.threads
    variants = {name: (LAYOUTS[name], {}) for name in args.layouts}
    for item in args.server_env:
        key, _, value = item.partition("=")
        variants[f"split, {item}"] = ("true", {key: value})
    torch.set_num_threads(threads)
    longest = max(args.contexts)
    rows = []
    with tempfile.TemporaryDirectory(prefix="serve-overhead-") as workdir:
        for fmt in args.formats:
            engine = build_engine(args.model_id, fmt, longest, args.new_tokens, threads)
            results: dict[str, dict[int, list[dict[str, float]]]] = {
                name: {n: [] for n in args.contexts} for name in ["in-process", *variants]
            }
            for round_index in range(args.rounds):
                order = ["in-process", *variants]
                order = order if round_index % 2 == 0 else order[::-1]
                for name in order:
                    if name == "in-process":
                        for length in args.contexts:
                            results[name][length].append(in_process(engine, length, args.new_tokens))
                    else:
                        split, env = variants[name]
                        server_args = ["--engine-core-process", split, "--prometheus-port", "0"]
                        server_args += engine_args(fmt, longest, args.new_tokens, threads)
                        log = Path(workdir) / f"{fmt}-{order.index(name)}-{round_index}.log"
                        with LaunchedServer(args.model_id, server_args, log, env=env) as server:
                            stream_gaps(server.grpc_target, 32, 8)  # warm
                            for length in args.contexts:
                                results[name][length].append(served(server, length, args.new_tokens))
                    for length in args.contexts:
                        print(f"{fmt} round {round_index + 1} {name} {length}: {results[name][length][-1]}", flush=True)
            engine.close()
            for length in args.contexts:
                base = statistics.median(r["ms_per_token"] for r in results["in-process"][length])
                for name, per in results.items():
                    token = statistics.median(r["ms_per_token"] for r in per[length])
                    step = statistics.median(r["step_ms"] for r in per[length])
                    spread = [common.fmt(r["ms_per_token"] / base, 2) for r in per[length]]
                    core_cpu = statistics.median(r.get("core_cpu", float("nan")) for r in per[length])
                    api_cpu = statistics.median(r.get("api_cpu", float("nan")) for r in per[length])
                    rows.append(
                        [fmt, str(length), name, common.fmt(token, 2), common.fmt(step, 2)]
                        + [common.fmt(token - step, 2), common.ratio(token, base), " / ".join(spread)]
                        + [common.fmt(core_cpu, 2), common.fmt(api_cpu, 2)]
                    )
    headers = ["format", "context", "layout", "ms/token", "step ms", "between steps ms", "÷ in-process", "rounds"]
    headers += ["engine CPU ms/token", "API CPU ms/token"]
    print(
        "\n"
        + f"Single-stream decode, {args.model_id}, {threads} threads, {args.new_tokens} new tokens, "
        + f"medians of {args.rounds} alternating rounds.\n\n"
        + common.markdown_table(headers, rows)
    )


if __name__ == "__main__":
    main()
