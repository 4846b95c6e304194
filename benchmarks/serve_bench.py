"""Serving load test: the real server (`inference-service launch`, gRPC + Envoy REST) on loopback,
loaded over gRPC and over REST with the same requests, level by level.

Levels, each bounded in requests and in time, gRPC then REST at each level:
- closed loop: 1, 4, 16, 64 concurrent users, each sending its next request when its last ended;
- open loop: Poisson arrivals at a rate (default: 70% of the best closed-loop request rate the
  same API reached), so queueing shows in TTFT the way real traffic makes it;
- burst: the server's `--max-concurrent-requests` plus a few more, all at once, with short prompts:
  past the admission limit the only acceptable error is overload (RESOURCE_EXHAUSTED / 429).

Reported per level: time to first token, inter-token latency and end-to-end latency (p50, p90,
p99), request and token throughput, and errors. The run exits with status 1 if any error other
than overload happened, or overload where the client never had more requests in flight than the
limit. The load generator shares the machine with the server: on a small CPU it takes its share.

Usage: python benchmarks/serve_bench.py [--quick] [--model-id ID] [--concurrency 1 4 16 64]
Writes serve.md, serve.png and serve.json to benchmarks/results (quick runs: results/raw/quick).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm import tqdm  # noqa: E402

from benchmarks import common, loadgen, plots, tiny_model  # noqa: E402
from benchmarks.launched import LaunchedServer  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

FULL = {
    "concurrency": [1, 4, 16, 64],
    "prompt_tokens": 64,
    "max_new_tokens": 64,
    "min_requests": 8,
    "duration": 120.0,
    "max_concurrent_requests": 128,
    "burst_extra": 16,
}
# One server thread: on a busy 2-CPU machine two torch threads stall each other for hundreds of ms.
QUICK = {
    "concurrency": [1, 4],
    "prompt_tokens": 16,
    "max_new_tokens": 8,
    "min_requests": 4,
    "duration": 10.0,
    "max_concurrent_requests": 8,
    "burst_extra": 4,
    "server_threads": 1,
}
BURST_PROMPT_TOKENS = 16
BURST_NEW_TOKENS = 4


async def run_level(server: LaunchedServer, protocol: str, level: dict, args: argparse.Namespace) -> dict:
    """One level over one API; returns the level with its summary."""
    timeout = args.duration + args.request_timeout
    target = (
        loadgen.GrpcTarget(server.grpc_target, timeout)
        if protocol == "grpc"
        else loadgen.RestTarget(server.rest_url, timeout)
    )
    burst = level["mode"] == "burst"
    prompts = (
        loadgen.Prompts(min(BURST_PROMPT_TOKENS, args.prompt_tokens), BURST_NEW_TOKENS, seed=args.seed)
        if burst
        else loadgen.Prompts(args.prompt_tokens, args.max_new_tokens, seed=args.seed)
    )
    with tqdm(total=level["requests"], desc=f"{protocol:<4} {level['label']}", unit="req", leave=False) as bar:
        send = loadgen.Sender(target, prompts, on_done=bar.update)
        try:
            if level["mode"] == "closed":
                records = await loadgen.closed_loop(send, level["concurrency"], level["requests"], args.duration)
            elif level["mode"] == "open":
                records = await loadgen.open_loop(send, level["rate"], level["requests"], args.duration, args.seed)
            else:
                records = await loadgen.burst(send, level["requests"])
        finally:
            await target.close()
    summary = loadgen.summarize(records)
    summary["max_in_flight"] = send.max_in_flight
    # Overload is acceptable only where this client had more requests in flight than the limit.
    over_limit = send.max_in_flight > args.max_concurrent_requests
    summary["unexpected_overloaded"] = 0 if over_limit else summary["num_overloaded"]
    raw = [
        {"start": r.start, "tokens": [t - r.start for t in r.token_times], "end": r.end - r.start, "error": r.error}
        for r in records
    ]
    return {
        **level,
        "protocol": protocol,
        "prompt_tokens": prompts.prompt_tokens,
        "max_new_tokens": prompts.max_new_tokens,
        **summary,
        "records": raw,
    }


async def run_all(server: LaunchedServer, args: argparse.Namespace) -> list[dict]:
    warm_up = {"mode": "closed", "label": "warm-up", "concurrency": 1, "requests": 2}
    for protocol in args.protocols:  # first connections, first calls: not measured
        await run_level(server, protocol, warm_up, args)
    results: list[dict] = []
    for concurrency in args.concurrency:
        level = {
            "mode": "closed",
            "label": f"closed c={concurrency}",
            "concurrency": concurrency,
            "requests": max(args.min_requests, 2 * concurrency),
        }
        for protocol in args.protocols:
            results.append(await run_level(server, protocol, level, args))
    for protocol in args.protocols:
        for rate in open_loop_rates(results, protocol, args):
            requests = max(1, min(args.max_open_requests, math.ceil(rate * args.duration)))
            level = {
                "mode": "open",
                "label": f"Poisson {rate:.2f}/s",
                "rate": rate,
                "concurrency": None,
                "requests": requests,
            }
            results.append(await run_level(server, protocol, level, args))
    if args.burst_extra > 0:
        count = args.max_concurrent_requests + args.burst_extra
        level = {
            "mode": "burst",
            "label": f"burst {count} (limit {args.max_concurrent_requests})",
            "concurrency": count,
            "requests": count,
        }
        for protocol in args.protocols:
            results.append(await run_level(server, protocol, level, args))
    return results


def open_loop_rates(results: list[dict], protocol: str, args: argparse.Namespace) -> list[float]:
    if args.rates is not None:
        return args.rates
    closed = [
        r["request_throughput"] for r in results if r["protocol"] == protocol and r["mode"] == "closed" and r["num_ok"]
    ]
    return [round(args.auto_rate_fraction * max(closed), 3)] if closed else []


# -- reporting ------------------------------------------------------------------------------------
def report(results: list[dict], args: argparse.Namespace, server: LaunchedServer, info, plot_name: str) -> str:
    header = (
        f"**Model** {model_name(args, info)} ({info.model_dtype}, {info.model_device_type}); server limits: "
        f"max_concurrent_requests {info.max_concurrent_requests}, max_batch_prefill_tokens "
        f"{info.max_batch_prefill_tokens}, KV cache {info.max_batch_total_tokens} tokens.\n\n"
        f"**Workload** streaming requests, greedy; prompts of {args.prompt_tokens} tokens (English text, "
        f"`truncate`), up to {args.max_new_tokens} new tokens (EOS ends some early: see tokens/req). Closed "
        f"loop: each user sends its next request when its last ended, max(min_requests {args.min_requests}, "
        f"2 × users) requests per level; open loop: Poisson arrivals; burst: limit + {args.burst_extra} at once "
        f"({BURST_PROMPT_TOKENS}-token prompts, {BURST_NEW_TOKENS} new tokens). Each level stops sending after "
        f"{args.duration:.0f} s. gRPC through `textgen_client`, REST `/generate_stream` (SSE) through Envoy; "
        f"the load generator runs on the same machine as the server.\n\n"
        f"**Machine** {common.machine_line(common.machine())}.\n\n"
        f"**Server** `{server.command}`\n\n**Command** `{common.command_line()}`"
    )
    rows = []
    for r in results:
        ttft, itl, e2e = r["ttft_ms"], r["itl_ms"], r["e2e_s"]
        errors = f"{r['num_overloaded']} / {r['num_other_errors']}"
        if r["unexpected_overloaded"] or r["num_other_errors"]:
            errors += " ⚠"
        rows.append(
            [
                "gRPC" if r["protocol"] == "grpc" else "REST",
                r["label"],
                f"{r['num_ok']}/{r['num_requests']}",
                errors,
                common.fmt(r["request_throughput"], 2),
                common.fmt(r["token_throughput"]),
                common.fmt(r["tokens_per_request"]),
                common.fmt(ttft["p50"], 0),
                common.fmt(ttft["p90"], 0),
                common.fmt(ttft["p99"], 0),
                common.fmt(itl["p50"]),
                common.fmt(itl["p90"]),
                common.fmt(itl["p99"]),
                common.fmt(e2e["p50"], 2),
                common.fmt(e2e["p90"], 2),
                common.fmt(e2e["p99"], 2),
            ]
        )
    table = common.markdown_table(
        [
            "API",
            "load",
            "ok",
            "429 / other errors",
            "req/s",
            "tok/s",
            "tokens/req",
            "TTFT p50 ms",
            "p90",
            "p99",
            "ITL p50 ms",
            "p90",
            "p99",
            "E2E p50 s",
            "p90",
            "p99",
        ],
        rows,
    )
    return (
        f"{header}\n\n{table}\n\n{gateway_table(results)}\n\n![throughput, TTFT and ITL vs concurrency]({plot_name})\n"
    )


def model_name(args: argparse.Namespace, info) -> str:
    return "tiny random Llama" if args.model_id == tiny_model.TINY_MODEL_ID else info.model_id


def gateway_table(results: list[dict]) -> str:
    """REST through Envoy against gRPC direct, level by level (ratios survive the machine's drift)."""
    by_key = {(r["protocol"], r["label"]): r for r in results}
    rows = []
    for r in results:
        other = by_key.get(("rest", r["label"]))
        if r["protocol"] != "grpc" or other is None or r["mode"] == "burst":
            continue
        rows.append(
            [
                r["label"],
                common.ratio(other["token_throughput"], r["token_throughput"]),
                common.fmt(other["ttft_ms"]["p50"] - r["ttft_ms"]["p50"], 1),
                common.fmt(other["itl_ms"]["p50"] - r["itl_ms"]["p50"], 2),
            ]
        )
    return common.markdown_table(
        ["load", "REST ÷ gRPC tok/s", "TTFT p50 added by REST (ms)", "ITL p50 added by REST (ms)"], rows
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model-id",
        help=f"model to serve (default: {DEMO_MODEL_ID}; quick: a tiny random model, `{tiny_model.TINY_MODEL_ID}`)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, c=1 and 4, short requests")
    parser.add_argument("--concurrency", type=int, nargs="+", help="closed-loop users per level")
    parser.add_argument("--protocols", nargs="+", choices=["grpc", "rest"], default=["grpc", "rest"])
    parser.add_argument("--prompt-tokens", type=int)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--min-requests", type=int, help="requests per closed level: max(this, 2 × users)")
    parser.add_argument("--duration", type=float, help="seconds after which a level sends no new request")
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds a request may take past the level's duration"
    )
    parser.add_argument(
        "--rates",
        type=float,
        nargs="*",
        help="open-loop arrival rates (req/s); default: "
        "--auto-rate-fraction of the best closed-loop rate; none given: no open loop",
    )
    parser.add_argument("--auto-rate-fraction", type=float, default=0.7)
    parser.add_argument("--max-open-requests", type=int, default=64)
    parser.add_argument("--max-concurrent-requests", type=int, help="the server's admission limit")
    parser.add_argument("--burst-extra", type=int, help="requests past the limit in the burst (0: no burst)")
    parser.add_argument(
        "--server-threads", type=int, help="the server's --num-threads (default: torch's choice; quick: 1)"
    )
    parser.add_argument("--server-args", default="", help="more `inference-service launch` flags, one string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    if args.model_id is None:
        args.model_id = tiny_model.TINY_MODEL_ID if args.quick else DEMO_MODEL_ID
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if min(args.concurrency) < 1 or args.duration <= 0 or any(rate <= 0 for rate in args.rates or ()):
        parser.error("concurrency levels, --duration and --rates must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = common.output_dir(args.out, args.quick)
    raw = common.RAW_DIR if out == common.RESULTS_DIR else out
    server_args = [
        "--max-concurrent-requests",
        str(args.max_concurrent_requests),
        "--graceful-termination-timeout",
        "5",
        *shlex.split(args.server_args),
    ]
    if args.server_threads:
        server_args += ["--num-threads", str(args.server_threads)]
    print(f"starting the server ({args.model_id}) ...", file=sys.stderr)
    with LaunchedServer(tiny_model.resolve(args.model_id), server_args, raw / "serve-server.log") as server:
        info = asyncio.run(server_info(server))
        args.max_concurrent_requests = info.max_concurrent_requests
        results = asyncio.run(run_all(server, args))
    markdown = report(results, args, server, info, "serve.png")
    plots.serve_overview(results, out / "serve.png", title=f"{model_name(args, info)} ({info.model_dtype}): serving")
    (out / "serve.md").write_text(markdown)
    common.write_json(
        raw / "serve-requests.json",
        [{"protocol": r["protocol"], "label": r["label"], "requests": r.pop("records")} for r in results],
    )
    common.write_json(out / "serve.json", {"args": vars(args), "machine": common.machine(), "levels": results})
    if out == common.RESULTS_DIR:
        common.update_readme("serve-results", markdown.replace("](serve.png)", "](results/serve.png)"))
    print("\n" + markdown)
    print(f"written: {out / 'serve.md'}, {out / 'serve.png'}, {out / 'serve.json'}")
    bad = [r["label"] + f" ({r['protocol']})" for r in results if r["num_other_errors"] or r["unexpected_overloaded"]]
    if bad:
        print(f"unexpected errors at: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


async def server_info(server: LaunchedServer):
    client = loadgen.AsyncClient(server.grpc_target, timeout=30)
    try:
        return await client.info()
    finally:
        await client.close()


if __name__ == "__main__":
    sys.exit(main())
