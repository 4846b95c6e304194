"""What the Envoy gateway adds: the same calls over REST (through Envoy) and over gRPC (direct), in
one run, on one server, interleaved call by call so both see the same machine state.

Rows:
- /health vs Health: the gateway alone (no model work);
- /generate vs Generate, `max_new_tokens` 1 and 16: latency (p50, p99);
- /generate_stream vs GenerateStream: time to the first token, and to the last.

Both clients keep one connection open (http.client keep-alive, one gRPC channel). The target is
under 1 ms added at p50. Usage:
    python benchmarks/gateway_latency.py [--model-id ID] [--requests N] [--envoy-concurrency N]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protos"))

from gateway.config import GatewayConfig  # noqa: E402
from gateway.envoy import Envoy  # noqa: E402
from inference_service.api.config import ServerConfig  # noqa: E402
from inference_service.config import DEMO_MODEL_ID, EngineConfig, ModelConfig  # noqa: E402
from textgen.v1 import generate_pb2 as pb  # noqa: E402
from textgen.v1 import generate_pb2_grpc  # noqa: E402

PROMPT = "What is Deep Learning?"


class ServerThread:
    """The gRPC server on its own event loop thread (as `inference-service serve` runs it)."""

    def __init__(self, engine_config: EngineConfig):
        from inference_service.api.server import ApiServer

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        config = ServerConfig(hostname="127.0.0.1", grpc_port=0)

        async def build():
            return ApiServer(config, engine_config)

        self.server = self.call(build())
        self.port = self.call(self.server.start())
        self.call(self.server.load_engine())

    def call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(600)

    def stop(self) -> None:
        self.call(self.server.shutdown(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)


class Rest:
    """One keep-alive HTTP/1.1 connection to Envoy."""

    def __init__(self, port: int):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)

    def get(self, path: str) -> bytes:
        self.connection.request("GET", path)
        return self.connection.getresponse().read()

    def post(self, path: str, body: dict) -> bytes:
        self.connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        data = response.read()
        assert response.status == 200, data
        return data

    def stream(self, body: dict) -> tuple[float, float]:
        """(seconds to the first event, seconds to the end)."""
        start = time.perf_counter()
        self.connection.request("POST", "/generate_stream", json.dumps(body), {"Content-Type": "application/json"})
        response = self.connection.getresponse()
        first = None
        for line in response:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - start
        return first, time.perf_counter() - start


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def grpc_stream(stub, request) -> tuple[float, float]:
    start = time.perf_counter()
    first = None
    for _ in stub.GenerateStream(request, timeout=120):
        if first is None:
            first = time.perf_counter() - start
    return first, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(name: str, rest: list[float], grpc_: list[float]) -> str:
    ms = 1e3
    p50r, p50g = statistics.median(rest) * ms, statistics.median(grpc_) * ms
    p99r, p99g = percentile(rest, 0.99) * ms, percentile(grpc_, 0.99) * ms
    return f"{name:<34} {p50r:>9.3f} {p50g:>9.3f} {p50r - p50g:>+9.3f}   {p99r:>9.3f} {p99g:>9.3f} {p99r - p99g:>+9.3f}"


def run(args: argparse.Namespace) -> None:
    model = ModelConfig(model_id=args.model_id, device="cpu" if args.cpu else "auto")
    server = ServerThread(EngineConfig(model=model))
    with tempfile.TemporaryDirectory() as workdir:
        envoy = Envoy(
            GatewayConfig(hostname="127.0.0.1", port=0, upstream_port=server.port, admin_port=0),
            Path(workdir),
            concurrency=args.envoy_concurrency,
            log_level="warning",
        )
        envoy.start()
        try:
            measure(args, server, envoy)
        finally:
            envoy.stop()
            server.stop()


def measure(args: argparse.Namespace, server: ServerThread, envoy: Envoy) -> None:
    rest = Rest(envoy.port)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    print(
        f"model {args.model_id}, {args.requests} calls per row (after {args.warmup} warm-up), "
        f"one client, sequential; Envoy concurrency {args.envoy_concurrency}; times in ms"
    )
    print(f"{'':<34} {'REST p50':>9} {'gRPC p50':>9} {'added':>9}   {'REST p99':>9} {'gRPC p99':>9} {'added':>9}")
    lines = _Printer()
    for max_new_tokens in (None, 1, 16):
        parameters = {} if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
        body = {"inputs": PROMPT, "parameters": parameters}
        request = pb.GenerateRequest(inputs=PROMPT, parameters=pb.GenerateParameters(**parameters))
        if max_new_tokens is None:
            name = "GET /health vs Health"
            calls = (lambda: rest.get("/health"), lambda: stub.Health(pb.HealthRequest(), timeout=60))
        else:
            name = f"POST /generate vs Generate ({max_new_tokens} tok)"
            calls = (lambda b=body: rest.post("/generate", b), lambda r=request: stub.Generate(r, timeout=120))
        for _ in range(args.warmup):
            calls[0](), calls[1]()
        rest_s, grpc_s = [], []
        for _ in range(args.requests):
            rest_s.append(timed(calls[0]))
            grpc_s.append(timed(calls[1]))
        lines.append(row(name, rest_s, grpc_s))

    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 16}}
    request = pb.GenerateRequest(inputs=PROMPT, parameters=pb.GenerateParameters(max_new_tokens=16))
    for _ in range(args.warmup):
        rest.stream(body), grpc_stream(stub, request)
    rest_ttft, grpc_ttft, rest_total, grpc_total = [], [], [], []
    for _ in range(args.requests):
        first, total = rest.stream(body)
        rest_ttft.append(first)
        rest_total.append(total)
        first, total = grpc_stream(stub, request)
        grpc_ttft.append(first)
        grpc_total.append(total)
    lines.append(row("stream: first token (16 tok)", rest_ttft, grpc_ttft))
    lines.append(row("stream: last token (16 tok)", rest_total, grpc_total))
    channel.close()


class _Printer:
    """Rows are printed as they are measured (a slow model still shows the first ones)."""

    def append(self, line: str) -> None:
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-id", default=DEMO_MODEL_ID)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--envoy-concurrency", type=int, default=1)
    parser.add_argument("--cpu", action="store_true", help="run the model on CPU even if CUDA is there")
    logging.basicConfig(level=logging.WARNING)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
