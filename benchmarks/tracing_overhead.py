"""Tracing overhead: throughput with every request traced (sampled at 100%, exported over OTLP/gRPC)
against tracing off, on two servers in one process, in one run.

Both servers load the same model; a collector stand-in (the OTLP/gRPC trace service, counting spans)
runs in a child process so its work is not billed to the traced server's process. Each round sends the
same burst of Generate calls (fixed `--concurrency` client threads, each call with its own
`traceparent`, as an instrumented caller sends) to one server then the other, alternating which goes
first, so machine drift hits both alike. Reported: requests/s and generated tokens/s per mode (median
over rounds), the ratio traced ÷ untraced per round and its median, and how many spans the collector
received (4 per request: the gRPC server span and validation, queued, inference).

Usage: python benchmarks/tracing_overhead.py [--quick] [--model-id ID] [--rounds N] [--concurrency N]
Writes tracing_overhead.md and .json to benchmarks/results (quick runs: results/raw/quick).
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protos"))

from benchmarks import common, tiny_model  # noqa: E402
from inference_service.config import DEMO_MODEL_ID  # noqa: E402

SPANS_PER_REQUEST = 4
# Chat-formatted, so an instruct model answers at length instead of ending at once.
PROMPT = "<|im_start|>user\nWhat is Deep Learning? Explain it to a curious student.<|im_end|>\n<|im_start|>assistant\n"


# -- the collector stand-in (child process) --------------------------------------------------------
def run_receiver() -> None:
    """Print the port, count spans until stdin closes, print the count."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    count = [0]
    lock = threading.Lock()

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 — the service's method name
            spans = sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            with lock:
                count[0] += spans
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(f"port {port}", flush=True)
    sys.stdin.read()
    server.stop(1).wait()
    print(f"spans {count[0]}", flush=True)


class ReceiverProcess:
    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--receiver"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.port = int(self.process.stdout.readline().split()[1])

    def stop(self) -> int:
        self.process.stdin.close()
        line = self.process.stdout.readline()
        self.process.wait(30)
        return int(line.split()[1]) if line.startswith("spans") else -1


# -- the two servers ---------------------------------------------------------------------------------
class ServerThread:
    """An `ApiServer` on its own event loop thread, loaded; a blocking stub to call it."""

    def __init__(self, engine_config, **server_options):
        import grpc

        from inference_service.api.config import ServerConfig
        from inference_service.api.server import ApiServer
        from textgen.v1 import generate_pb2_grpc

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        config = ServerConfig(hostname="127.0.0.1", grpc_port=0, prometheus_port=0, **server_options)

        async def build():
            return ApiServer(config, engine_config)

        self.server = self.call(build())
        self.port = self.call(self.server.start())
        self.call(self.server.load_engine())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generate_pb2_grpc.TextGenerationStub(self.channel)

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(600)

    def stop(self) -> None:
        self.channel.close()
        self.call(self.server.shutdown(1.0))  # exports the last spans
        self.loop.call_soon_threadsafe(self.loop.stop)


def burst(server: ServerThread, pool: futures.ThreadPoolExecutor, num_requests: int, max_new_tokens: int) -> dict:
    """`num_requests` Generate calls through `pool`; wall time and generated tokens."""
    from textgen.v1 import generate_pb2 as pb

    request = pb.GenerateRequest(
        inputs=PROMPT, parameters=pb.GenerateParameters(max_new_tokens=max_new_tokens, details=True)
    )

    def one(_: int) -> int:
        traceparent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
        response = server.stub.Generate(request, metadata=(("traceparent", traceparent),), timeout=600)
        return response.details.generated_tokens

    started = time.perf_counter()
    tokens = sum(pool.map(one, range(num_requests)))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "requests_per_s": num_requests / seconds, "tokens_per_s": tokens / seconds}


def run(args: argparse.Namespace) -> dict:
    from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig

    engine_config = EngineConfig(
        model=ModelConfig(model_id=tiny_model.resolve(args.model_id), device=args.device, num_threads=args.num_threads),
        cache=CacheConfig(max_batch_total_tokens=args.kv_tokens),
        limits=LimitsConfig(max_total_tokens=1024),
    )
    receiver = ReceiverProcess()
    servers = {
        "off": ServerThread(engine_config),
        "on": ServerThread(
            engine_config, otlp_endpoint=f"http://127.0.0.1:{receiver.port}", otlp_service_name="tracing-overhead"
        ),
    }
    rounds: list[dict] = []
    try:
        with futures.ThreadPoolExecutor(args.concurrency) as pool:
            for mode in ("off", "on"):  # warm-up: first calls, channels, exporter connection
                burst(servers[mode], pool, args.concurrency, args.max_new_tokens)
            for index in range(args.rounds):
                order = ("off", "on") if index % 2 == 0 else ("on", "off")
                result = {mode: burst(servers[mode], pool, args.requests, args.max_new_tokens) for mode in order}
                result["ratio"] = result["on"]["tokens_per_s"] / result["off"]["tokens_per_s"]
                rounds.append(result)
                print(
                    f"round {index + 1}/{args.rounds}: off {result['off']['tokens_per_s']:.1f} tok/s, "
                    f"on {result['on']['tokens_per_s']:.1f} tok/s, on/off {result['ratio']:.3f}",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
        spans = receiver.stop()
    num_traced = args.rounds * args.requests + args.concurrency
    return {"rounds": rounds, "spans_received": spans, "spans_expected": num_traced * SPANS_PER_REQUEST}


def report(args: argparse.Namespace, outcome: dict) -> str:
    rounds = outcome["rounds"]

    def median(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in rounds)

    ratios = [r["ratio"] for r in rounds]
    rows = [
        (mode, common.fmt(median(mode, "requests_per_s"), 2), common.fmt(median(mode, "tokens_per_s")))
        for mode in ("off", "on")
    ]
    table = common.markdown_table(("tracing", "requests/s (median)", "tokens/s (median)"), rows)
    return (
        "\n".join(
            [
                "## Tracing overhead (`tracing_overhead.py`)",
                "",
                f"Machine: {common.machine_line(common.machine())}",
                f"Command: `{common.command_line()}`",
                f"Model {args.model_id}, {args.rounds} rounds × {args.requests} Generate calls, "
                f"{args.concurrency} concurrent clients, {args.max_new_tokens} new tokens each.",
                "",
                table,
                "",
                f"Traced ÷ untraced tokens/s: median **{statistics.median(ratios):.3f}** "
                f"(per round: {', '.join(f'{r:.3f}' for r in ratios)}).",
                f"Spans received by the collector: {outcome['spans_received']} "
                f"of {outcome['spans_expected']} expected.",
            ]
        )
        + "\n"
    )


def main() -> None:
    if "--receiver" in sys.argv:
        run_receiver()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny random model, few short rounds")
    parser.add_argument("--model-id", default=None, help=f"default: {DEMO_MODEL_ID}; `tiny` with --quick")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="Generate calls per round and mode")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    quick = args.quick
    args.model_id = args.model_id or (tiny_model.TINY_MODEL_ID if quick else DEMO_MODEL_ID)
    args.rounds = args.rounds or (2 if quick else 6)
    args.requests = args.requests or (8 if quick else 48)
    args.max_new_tokens = args.max_new_tokens or (8 if quick else 32)
    outcome = run(args)
    markdown = report(args, outcome)
    print(markdown)
    folder = common.output_dir(args.out, quick)
    (folder / "tracing_overhead.md").write_text(markdown)
    common.write_json(folder / "tracing_overhead.json", {"args": vars(args), **outcome})


if __name__ == "__main__":
    main()
