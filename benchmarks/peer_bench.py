"""The server against llama.cpp's `llama-server` on the same GGUF weights, side by side in one run.

Both are real servers on loopback, measured by streaming from a client, side by side:

- **Decode at context L** (L = 128 … 16k): one stream, a prompt of exactly L tokens, 64 new tokens,
  greedy; decode ms/token = the gap between the first and the last token ÷ the tokens between.
  Ours: `inference-service launch --num-threads 2 --prefix-caching false`, gRPC, one row per
  `--kv-dtypes` (fp16 is the like-for-like row against llama.cpp's default f16 KV cache; auto is
  the model's fp32). llama.cpp: `llama-server -t 2 -tb 2 -np 1 -c <longest + 64>`, `/completion`
  streamed with `cache_prompt: false` and the same token ids. Every row's server is up at once and
  the streams interleave over `--decode-rounds` rounds (default 3), alternating the order: the table
  gives each context's median round and every round's ratio.
- **Prefill tok/s** = L ÷ time to first token of the same requests (the table shows it at every L;
  the goals name 512 and 4k). Our step budget is `--max-batch-prefill-tokens 2048`, llama.cpp's
  default logical batch.
- **Batch throughput**: `--batch-requests` requests (prompts of 128 tokens, 64 new) from 16
  concurrent clients; generated tokens ÷ wall time. Ours with the first of `--kv-dtypes`;
  llama.cpp as `llama-server -np 16`. Both servers are up together and take `--batch-rounds` turns
  (alternating which goes first), so each round's ratio is side by side; the table gives the
  medians' ratio and every round's.
- **Long prompts** (`--sections long`): 8k and 16k-token prompts through our server with
  `--kv-cache-dtype int8` and the default `--kv-cache-memory` (the machine's budget): time to first
  token, decode ms/token, the KV pool the server sized and the server's peak resident memory.

Formats: `f32` (ours: the safetensors folder; llama.cpp: the F32 GGUF) and `q4_1` (both the Q4_1
GGUF; ours with `--quantize gguf`, and a second decode row with int8 activations,
`INFERENCE_SERVICE_QUANT_ACTIVATIONS=int8`, unless `--quant-activations fp32`). Models from
`peer_models.py`: `demo` (SmolLM2-135M, stated at 32k positions so 16k runs), `llama-0.5b`,
`llama-1.5b`. Our server ends a stream at EOS (its API has
no ignore_eos); llama.cpp is asked to ignore it: ms/token is per token either way.

Needs `python benchmarks/llama_cpp.py build` once (~10-20 min); the models are written on first use.

    python benchmarks/peer_bench.py --quick     # demo model, F32 + Q4_1, contexts 128/512/4k, batch: ~10 min quiet
    python benchmarks/peer_bench.py --quick --contexts 128 512 --batch-requests 16 --new-tokens 24  # a look
    python benchmarks/peer_bench.py             # demo + 1.5B, contexts 128 → 16k, batch, long: hours
    python benchmarks/peer_bench.py --models demo llama-1.5b --sections batch --tag batch  # batch rows only
    python benchmarks/peer_bench.py --models demo --contexts 8192 16384 --sections decode --threads 1  # busy machine

`--threads` sets both servers' threads (default 2). On a machine shared with other work, 1 thread
each keeps the comparison fair: a 2-thread step waits at every op for whichever of its threads the
kernel scheduled out (a demo decode step at 2k context took 1.8 s with 2 threads, 0.27 s with 1,
under a load of 12 on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common, llama_cpp, peer_models  # noqa: E402

CONTEXTS = [128, 512, 1024, 2048, 4096, 8192, 16384]
QUICK_CONTEXTS = [128, 512, 4096]
LONG_CONTEXTS = [8192, 16384]
NEW_TOKENS = 64
BATCH_PROMPT_TOKENS = 128
BATCH_CONCURRENCY = 16
PREFILL_BUDGET = 2048
THREADS = 2
SECTIONS = ("decode", "batch", "long")
KV_DTYPES = ("fp16", "auto")
LLAMA = "llama.cpp"
# Our opt-in int8 activations for 4-bit weights (inference_service/worker/kernels/int8_activations.py).
ACTIVATIONS_ENV = "INFERENCE_SERVICE_QUANT_ACTIVATIONS"


@dataclass
class Stream:
    """One streamed request as the client saw it (perf_counter seconds); `tokens` counts each arrival."""

    start: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None
    server_timings: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0][0] - self.start if self.arrivals else float("nan")

    @property
    def decode_ms(self) -> float:
        """First to last token ÷ the tokens that came after the first arrival."""
        after_first = self.tokens - self.arrivals[0][1] if self.arrivals else 0
        if after_first < 1:
            return float("nan")
        return 1000 * (self.arrivals[-1][0] - self.arrivals[0][0]) / after_first


# -- prompts --------------------------------------------------------------------------------------
class PromptMaker:
    """Prompts of exactly L tokens: English text (benchmarks/loadgen.py's), its last L token ids.
    Ours gets the text with `truncate=L` (it keeps the last L tokens); llama.cpp gets the ids."""

    def __init__(self, tokenizer_dir: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.tokenizer.model_max_length = 1 << 30  # it only counts: the longest prompts exceed the demo's 8k

    def make(self, length: int, index: int) -> tuple[str, list[int]]:
        from benchmarks.loadgen import Prompts

        text = Prompts(length, NEW_TOKENS, seed=length).text(index)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        if len(ids) < length:
            raise ValueError(f"prompt text gave {len(ids)} tokens, not {length}")
        return text, ids[-length:]


# -- the two servers ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LlamaServer:
    """`llama-server` on loopback; ready when /health answers 200."""

    def __init__(self, gguf: Path, parallel: int, context: int, log_path: Path, timeout_s: float = 600):
        import urllib.request

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [
            str(llama_cpp.binary("llama-server")),
            "-m",
            str(gguf),
            "-t",
            str(THREADS),
            "-tb",
            str(THREADS),
            "-np",
            str(parallel),
            "-c",
            str(context),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("w")
        # As its users start it: libgomp's own spinning, not the bound our package sets on import
        # for its own process tree (inference_service/openmp_wait.py), which this process inherited.
        env = {name: value for name, value in os.environ.items() if name != "GOMP_SPINCOUNT"}
        self.process = subprocess.Popen(
            self.command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server did not start; see {log_path}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._log.close()


async def stream_llama(session, url: str, ids: list[int], max_new: int) -> Stream:
    body = {
        "prompt": ids,
        "n_predict": max_new,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": False,
        "temperature": 0.0,
        "return_tokens": True,
    }
    record = Stream(time.perf_counter())
    predicted = 0
    async with session.post(url + "/completion", json=body) as response:
        if response.status != 200:
            record.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            return record
        async for line in response.content:
            if not line.startswith(b"data:"):
                continue
            event = json.loads(line[5:])
            # Counted by `tokens_predicted`, not by the event's `tokens`: the server holds back a token
            # that ends inside a UTF-8 character and sends it with the next, listing only one of them.
            count = event.get("tokens_predicted", predicted) - predicted
            if count > 0:
                predicted += count
                record.arrivals.append((time.perf_counter(), count))
            if event.get("stop"):
                record.server_timings = event.get("timings", {})
    return record


async def stream_ours(client, text: str, length: int, max_new: int) -> Stream:
    from textgen_client import TextGenerationError

    record = Stream(time.perf_counter())
    try:
        async for _ in client.generate_stream(text, max_new_tokens=max_new, truncate=length, details=False):
            record.arrivals.append((time.perf_counter(), 1))
    except TextGenerationError as error:
        record.error = f"{type(error).__name__}: {error}"[:200]
    return record


class Ours:
    """`inference-service launch` (benchmarks/launched.py) and a gRPC client."""

    def __init__(self, model_id: str, server_args: list[str], log_path: Path):
        from benchmarks.launched import LaunchedServer

        self.server = LaunchedServer(model_id, server_args, log_path, start_timeout_s=3600)
        self.log_tail = list(self.server._tail)

    def client(self):
        from textgen_client import AsyncClient, RetryPolicy

        return AsyncClient(self.server.grpc_target, timeout=3600, retry=RetryPolicy(max_retries=0))

    def stop(self) -> None:
        self.server.stop()


# -- what is measured -----------------------------------------------------------------------------
async def decode_sweep(send, prompts: PromptMaker, contexts: list[int], label: str) -> dict[int, Stream]:
    """One stream per context (none for no contexts), after a short warm-up request."""
    await send(*prompts.make(32, 999), 32, 8)
    results = {}
    for length in contexts:
        text, ids = prompts.make(length, 0)
        record = await send(text, ids, length, NEW_TOKENS)
        results[length] = record
        print(
            f"  {label}, context {length}: TTFT {record.ttft_s:.2f} s, decode {record.decode_ms:.1f} ms/token "
            f"({record.tokens} tokens){' ERROR ' + record.error if record.error else ''}",
            file=sys.stderr,
            flush=True,
        )
    return results


async def batch_run(send, prompts: PromptMaker, num_requests: int) -> dict:
    """`num_requests` requests from BATCH_CONCURRENCY closed-loop clients; tokens/s of the whole."""
    pending = list(range(num_requests))
    records: list[Stream] = []

    async def user() -> None:
        while pending:
            index = pending.pop()
            text, ids = prompts.make(BATCH_PROMPT_TOKENS, index)
            records.append(await send(text, ids, BATCH_PROMPT_TOKENS, NEW_TOKENS))

    started = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(BATCH_CONCURRENCY)))
    elapsed = time.perf_counter() - started
    tokens = sum(r.tokens for r in records)
    errors = [r.error for r in records if r.error]
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "errors": errors[:3]}


def ours_args(kv_dtype: str, fmt: str, longest: int, budget: bool = False) -> list[str]:
    args = ["--num-threads", str(THREADS), "--prefix-caching", "false", "--kv-cache-dtype", kv_dtype]
    args += ["--max-batch-prefill-tokens", str(PREFILL_BUDGET), "--max-total-tokens", str(longest + NEW_TOKENS)]
    args += ["--max-input-tokens", str(longest), "--max-concurrent-requests", "128"]
    if not budget:  # room for the longest context and a batch: sized, not the machine's share
        args += ["--max-batch-total-tokens", str(longest + NEW_TOKENS + 256 + BATCH_CONCURRENCY * 256)]
    if fmt != "f32":
        args += ["--quantize", "gguf"]
    return args


def ours_model(paths: dict[str, Path], fmt: str) -> str:
    return str(paths["hf"] if fmt == "f32" else paths[fmt])


def ours_label(kv_dtype: str, activations: str = "fp32") -> str:
    return f"ours {kv_dtype} KV" + (f", {activations} activations" if activations != "fp32" else "")


def start_ours(paths, fmt, kv_dtype, args, out: Path, activations: str = "fp32", longest: int | None = None) -> Ours:
    longest = longest or max(args.contexts + [BATCH_PROMPT_TOKENS])
    label = f"{ours_label(kv_dtype, activations)}, {fmt}"
    print(f"{label}: starting", file=sys.stderr, flush=True)
    log_path = out / f"{label}.log".replace(" ", "_").replace(",", "")
    # The server's processes inherit the environment: the opt-in activation format is set for it alone.
    saved = os.environ.get(ACTIVATIONS_ENV)
    os.environ[ACTIVATIONS_ENV] = activations
    try:
        return Ours(ours_model(paths, fmt), ours_args(kv_dtype, fmt, longest), log_path)
    finally:
        if saved is None:
            os.environ.pop(ACTIVATIONS_ENV, None)
        else:
            os.environ[ACTIVATIONS_ENV] = saved


def llama_session(url: str):
    """An aiohttp session for llama-server: a connection per request (after a long streamed response
    llama-server drops the kept-alive connection, and the next request written into it failed)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=3600)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True), timeout=timeout)


def run_decode(paths, fmt, args, prompts, out: Path) -> dict[str, dict[int, list[Stream]]]:
    """Every decode row's server up at once (ours per KV dtype and activation format, `llama-server
    -np 1`), then `--decode-rounds` rounds: in each, every context's stream runs on each server back to
    back, in an order that alternates round by round, so each round's ratio is side by side (a
    machine that slows for a minute slows both sides of it)."""
    rows = [(kv_dtype, "fp32") for kv_dtype in args.kv_dtypes]
    if fmt != "f32":
        rows += [(args.kv_dtypes[0], a) for a in args.quant_activations if a != "fp32"]
    servers: dict[str, Ours] = {}
    llama = None
    try:
        for kv_dtype, activations in rows:
            servers[ours_label(kv_dtype, activations)] = start_ours(paths, fmt, kv_dtype, args, out, activations)
        print(f"{LLAMA} {fmt}: starting -np 1", file=sys.stderr, flush=True)
        context = max(args.contexts) + NEW_TOKENS + 64
        llama = LlamaServer(paths[fmt], 1, context, out / f"llama-server-{fmt}-np1.log")
        return asyncio.run(decode_rounds(servers, llama.url, fmt, args, prompts))
    finally:
        if llama is not None:
            llama.stop()
        for server in servers.values():
            server.stop()


async def decode_rounds(servers: dict[str, Ours], url: str, fmt: str, args, prompts) -> dict:
    clients = {label: server.client() for label, server in servers.items()}

    def ours_sender(client):
        async def send(text, ids, length, max_new):
            return await stream_ours(client, text, length, max_new)

        return send

    async with llama_session(url) as session:

        async def send_llama(text, ids, length, max_new):
            return await stream_llama(session, url, ids, max_new)

        senders = {label: ours_sender(client) for label, client in clients.items()} | {LLAMA: send_llama}
        try:
            for send in senders.values():  # warm-up: first requests, threads started
                await send(*prompts.make(32, 999), 32, 8)
            results: dict[str, dict[int, list[Stream]]] = {name: {n: [] for n in args.contexts} for name in senders}
            for number in range(args.decode_rounds):
                order = list(senders) if number % 2 == 0 else list(senders)[::-1]
                for length in args.contexts:
                    text, ids = prompts.make(length, 0)
                    for name in order:
                        record = await senders[name](text, ids, length, NEW_TOKENS)
                        results[name][length].append(record)
                        print(
                            f"  {name}, {fmt}, round {number + 1}, context {length}: TTFT {record.ttft_s:.2f} s, "
                            f"decode {record.decode_ms:.1f} ms/token ({record.tokens} tokens)"
                            f"{' ERROR ' + record.error if record.error else ''}",
                            file=sys.stderr,
                            flush=True,
                        )
            return results
        finally:
            for client in clients.values():
                await client.close()


def median_stream(streams: list[Stream]) -> Stream:
    """The round whose decode ms/token is the median (the lower middle of an even count; failed last)."""
    ranked = sorted(streams, key=lambda s: (math.isnan(s.decode_ms), s.decode_ms))
    return ranked[(len(ranked) - 1) // 2]


def run_batch(paths, fmt, kv_dtype, args, prompts, out: Path) -> dict[str, dict]:
    """Batch throughput, our server and `llama-server -np 16` both up, in `--batch-rounds` rounds that
    alternate which goes first: each round's ratio is measured side by side, minutes apart at most."""
    ours = start_ours(paths, fmt, kv_dtype, args, out, longest=BATCH_PROMPT_TOKENS)
    llama = None
    try:
        print(f"{LLAMA} {fmt}: starting -np {BATCH_CONCURRENCY}", file=sys.stderr, flush=True)
        per_slot = BATCH_PROMPT_TOKENS + NEW_TOKENS + 64
        llama = LlamaServer(
            paths[fmt], BATCH_CONCURRENCY, BATCH_CONCURRENCY * per_slot, out / f"llama-server-{fmt}-np16.log"
        )
        url = llama.url

        async def go() -> dict[str, list[dict]]:
            client = ours.client()
            async with llama_session(url) as session:

                async def send_ours(text, ids, length, max_new):
                    return await stream_ours(client, text, length, max_new)

                async def send_llama(text, ids, length, max_new):
                    return await stream_llama(session, url, ids, max_new)

                senders = {ours_label(kv_dtype): send_ours, LLAMA: send_llama}
                for send in senders.values():  # warm-up: first requests, threads started
                    await send(*prompts.make(32, 999), 32, 8)
                rounds: dict[str, list[dict]] = {name: [] for name in senders}
                pids = {ours_label(kv_dtype): ours.server.process.pid, LLAMA: llama.process.pid}
                try:
                    for number in range(args.batch_rounds):
                        order = list(senders) if number % 2 == 0 else list(senders)[::-1]
                        for name in order:
                            idle = next(pid for other, pid in pids.items() if other != name)
                            idle_before = cpu_seconds(idle)
                            result = await batch_run(senders[name], prompts, args.batch_requests)
                            # what the other server, idle, took from the machine meanwhile (it should be ~0)
                            result["other_server_cpu_s"] = cpu_seconds(idle) - idle_before
                            rounds[name].append(result)
                            print(
                                f"  {name}, {fmt}, batch round {number + 1}: {result['tokens_per_s']:.1f} tok/s",
                                file=sys.stderr,
                                flush=True,
                            )
                finally:
                    await client.close()
                return rounds

        return {name: batch_summary(results) for name, results in asyncio.run(go()).items()}
    finally:
        if llama is not None:
            llama.stop()
        ours.stop()


def batch_summary(rounds: list[dict]) -> dict:
    """The rounds of one server: tokens/s of each, their median, and the first errors."""
    rates = [r["tokens_per_s"] for r in rounds]
    errors = [e for r in rounds for e in r["errors"]][:3]
    return {
        "tokens_per_s": statistics.median(rates),
        "rounds_tokens_per_s": rates,
        "other_server_cpu_s": [r["other_server_cpu_s"] for r in rounds],
        "errors": errors,
    }


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and its descendants so far, in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    queue = deque([pid])
    while queue:
        current = queue.popleft()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
            for task in Path(f"/proc/{current}/task").iterdir():
                queue.extend(int(child) for child in (task / "children").read_text().split())
        except (OSError, IndexError, ValueError):
            continue
    return total


def peak_rss_mib(pid: int) -> float:
    """The peak resident memory (VmHWM) of a process and its descendants, summed, in MiB."""
    total_kib = 0
    queue = deque([pid])
    while queue:
        current = queue.popleft()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total_kib += int(re.search(r"VmHWM:\s*(\d+)", status).group(1))
            for task in Path(f"/proc/{current}/task").iterdir():
                queue.extend(int(child) for child in (task / "children").read_text().split())
        except (OSError, AttributeError):
            continue
    return total_kib / 1024


def run_long(paths, args, prompts, out: Path) -> dict:
    """8k/16k prompts through our server, int8 KV, the default --kv-cache-memory: TTFT and memory."""
    longest = max(LONG_CONTEXTS)
    label = "ours f32, int8 KV, default budget"
    print(f"{label}: starting", file=sys.stderr, flush=True)
    available_mib = mem_available_mib()
    server = Ours(ours_model(paths, "f32"), ours_args("int8", "f32", longest, budget=True), out / "long.log")
    try:
        pool = next((m.groups() for m in map(KV_BLOCKS.search, server.log_tail) if m), None)

        async def go():
            client = server.client()

            async def send(text, ids, length, max_new):
                return await stream_ours(client, text, length, max_new)

            try:
                return await decode_sweep(send, prompts, LONG_CONTEXTS, label)
            finally:
                await client.close()

        streams = asyncio.run(go())
        rss = peak_rss_mib(server.server.process.pid)
    finally:
        server.stop()
    kv_tokens = int(pool[0]) * int(pool[1]) if pool else None
    return {"streams": streams, "kv_pool_tokens": kv_tokens, "peak_rss_mib": rss, "available_mib": available_mib}


def mem_available_mib() -> float:
    """The machine's memory budget: what /proc/meminfo calls available, before the server starts."""
    match = re.search(r"MemAvailable:\s*(\d+)", Path("/proc/meminfo").read_text())
    return int(match.group(1)) / 1024 if match else float("nan")


KV_BLOCKS = re.compile(r"(\d+) KV blocks of (\d+) tokens")


# -- the report -----------------------------------------------------------------------------------
def decode_table(
    model: str, fmt: str, rows: dict[str, dict[int, Stream]], rounds: dict[str, dict[int, list[Stream]]], contexts
) -> str:
    names = list(rows)
    header = ["context", *(f"{n} ms/token" for n in names)]
    header += [f"{n} ÷ {LLAMA}" for n in names if n != LLAMA]
    header += [f"{n} ÷ {LLAMA}, each round" for n in names if n != LLAMA]
    header += [f"{n} prefill tok/s" for n in names]
    table = []
    for length in contexts:
        decode = {n: rows[n][length].decode_ms for n in names}
        prefill = {n: length / rows[n][length].ttft_s for n in names}
        row = [f"{length:,}", *(common.fmt(decode[n]) for n in names)]
        row += [common.ratio(decode[n], decode[LLAMA]) for n in names if n != LLAMA]
        row += [
            ", ".join(
                f"{a.decode_ms / b.decode_ms:.2f}"
                for a, b in zip(rounds[n][length], rounds[LLAMA][length], strict=True)
            )
            for n in names
            if n != LLAMA
        ]
        row += [common.fmt(prefill[n], 0) for n in names]
        table.append(row)
    return (
        f"#### {model}, {fmt.upper()}: decode and prefill against context\n\n{common.markdown_table(header, table)}\n"
    )


def report(results: dict, args: argparse.Namespace, machine: dict, plot_names: list[str]) -> str:
    parts = [
        f"### Against llama.cpp (`llama-server` {llama_cpp.VERSION}), {THREADS} threads each, same GGUF weights\n",
        f"Decode ms/token: one stream, 64 new tokens, first-to-last gap (lower is better), the median of "
        f"{args.decode_rounds} interleaved round(s) with every server up; ratios are ours ÷ "
        "llama.cpp (below 1: we are faster). Prefill tok/s = context ÷ time to first token (higher is better). "
        "llama.cpp's KV cache is f16: `fp16` is the like-for-like row.\n",
    ]
    for model, by_format in results.items():
        for fmt, entry in by_format.items():
            if entry.get("decode"):
                parts.append(decode_table(model, fmt, entry["decode"], entry["decode_rounds"], args.contexts))
    batch_rows = []
    for model, by_format in results.items():
        for fmt, entry in by_format.items():
            batch = entry.get("batch", {})
            if LLAMA in batch and len(batch) > 1:
                ours, llama = batch[next(n for n in batch if n != LLAMA)], batch[LLAMA]
                ratios = [a / b for a, b in zip(ours["rounds_tokens_per_s"], llama["rounds_tokens_per_s"], strict=True)]
                batch_rows.append(
                    [
                        model,
                        fmt.upper(),
                        common.fmt(ours["tokens_per_s"]),
                        common.fmt(llama["tokens_per_s"]),
                        f"**{common.ratio(ours['tokens_per_s'], llama['tokens_per_s'])}**",
                        ", ".join(f"{r:.2f}×" for r in ratios),
                        # each server's CPU time while idle during the other's rounds (it should be ~0)
                        f"{max(llama['other_server_cpu_s']):.1f} / {max(ours['other_server_cpu_s']):.1f}",
                    ]
                )
    if batch_rows:
        header = ["model", "weights", "ours tok/s", f"{LLAMA} -np {BATCH_CONCURRENCY} tok/s", "ours ÷ llama.cpp"]
        header += ["each round's ratio", "idle CPU s, ours / llama.cpp (max per round)"]
        parts.append(
            f"#### Batch throughput: {args.batch_requests} requests, {BATCH_CONCURRENCY} concurrent, "
            f"{BATCH_PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens (goal ≥ 1.5×)\n\n"
            f"Both servers up, {args.batch_rounds} round(s) alternating which goes first; tok/s are the "
            "rounds' medians.\n\n" + common.markdown_table(header, batch_rows) + "\n"
        )
    long_rows = []
    for model, by_format in results.items():
        for long in (entry["long"] for entry in by_format.values() if "long" in entry):
            for length, record in long["streams"].items():
                long_rows.append(
                    [
                        model,
                        f"{length:,}",
                        "ok" if not record.error and record.tokens else f"failed: {record.error}",
                        common.fmt(record.ttft_s, 2),
                        common.fmt(length / record.ttft_s, 0),
                        common.fmt(record.decode_ms),
                        f"{long['kv_pool_tokens']:,}" if long["kv_pool_tokens"] else "–",
                        common.fmt(long["peak_rss_mib"], 0),
                        common.fmt(long["available_mib"], 0),
                        "yes" if long["peak_rss_mib"] < long["available_mib"] else "**no**",
                    ]
                )
    if long_rows:
        header = ["model", "prompt", "served", "TTFT s", "prefill tok/s", "decode ms/token", "KV pool tokens"]
        header += ["server peak RSS MiB", "available at start MiB", "within it"]
        parts.append(
            "#### Long prompts end to end: F32 weights, `--kv-cache-dtype int8`, the default `--kv-cache-memory`\n\n"
            + common.markdown_table(header, long_rows)
            + "\n"
        )
    parts += [f"![decode ms/token against context]({name})\n" for name in plot_names]
    parts.append(f"{common.machine_line(machine)}\n\n`{common.command_line()}`\n")
    return "\n".join(parts)


def plot(results: dict, args: argparse.Namespace, out: Path) -> list[str]:
    from benchmarks import plots

    names = []
    for model, by_format in results.items():
        series = {}
        for fmt, entry in by_format.items():
            for name, streams in entry.get("decode", {}).items():
                series[f"{name}, {fmt.upper()}"] = (args.contexts, [streams[n].decode_ms for n in args.contexts])
        if series:
            name = f"peers_{args.tag}_{model}.png" if args.tag else f"peers_{model}.png"  # beside the tag's md
            plots.lines_against(
                series,
                out / name,
                title=f"decode ms/token against context, {model}, {THREADS} threads",
                xlabel="context length (tokens)",
                ylabel="decode ms/token (streamed, one stream)",
            )
            names.append(name)
    return names


def as_json(results: dict) -> dict:
    def convert(value):
        if isinstance(value, Stream):
            return {"ttft_s": value.ttft_s, "decode_ms": value.decode_ms, "tokens": value.tokens, "error": value.error}
        if isinstance(value, dict):
            return {str(k): convert(v) for k, v in value.items()}
        if isinstance(value, list):
            return [convert(v) for v in value]
        return value

    return convert(results)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="demo model, contexts 128/512/4k, 32 batch requests")
    parser.add_argument("--models", nargs="+", choices=list(peer_models.SHAPES), help="default: demo llama-1.5b")
    parser.add_argument("--formats", nargs="+", choices=["f32", "q4_1"], default=["f32", "q4_1"])
    parser.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, help="our KV rows (default: fp16 auto)")
    parser.add_argument("--contexts", nargs="+", type=int, help=f"default: {CONTEXTS}")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, help="default: all (quick: decode batch)")
    parser.add_argument("--batch-requests", type=int, help="default: 64 (quick: 32)")
    parser.add_argument(
        "--batch-rounds", type=int, default=3, help="batch runs per server, alternating with llama.cpp (default: 3)"
    )
    parser.add_argument(
        "--decode-rounds", type=int, default=3, help="decode streams per server and context, interleaved (default: 3)"
    )
    parser.add_argument("--tag", help="results as peers_<tag>.md/json (e.g. batch), beside the full run's")
    parser.add_argument(
        "--quant-activations",
        nargs="+",
        choices=["fp32", "int8"],
        default=["fp32", "int8"],
        help="our activation formats for Q4_1 weights, a decode row each (int8: opt-in, changes numerics)",
    )
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help=f"per request (default: {NEW_TOKENS})")
    parser.add_argument(
        "--threads", type=int, default=THREADS, help=f"threads of each server (default: {THREADS}; 1 on a busy machine)"
    )
    parser.add_argument("--out", help="output folder (default: benchmarks/results, quick: results/raw/quick)")
    args = parser.parse_args(argv)
    args.models = args.models or (["demo"] if args.quick else ["demo", "llama-1.5b"])
    args.kv_dtypes = args.kv_dtypes or (["fp16"] if args.quick else list(KV_DTYPES))
    args.contexts = sorted(args.contexts or (QUICK_CONTEXTS if args.quick else CONTEXTS))
    args.sections = args.sections or (["decode", "batch"] if args.quick else list(SECTIONS))
    args.batch_requests = args.batch_requests or (32 if args.quick else 64)
    if args.batch_rounds < 1 or args.decode_rounds < 1:
        parser.error("--batch-rounds and --decode-rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    global NEW_TOKENS, THREADS
    args = parse_args(argv)
    NEW_TOKENS = args.new_tokens  # fewer only for a look on a busy machine: ms/token is per token
    THREADS = args.threads  # 1 on a busy machine: 2 threads that wait on each other wait on the others' work
    if {"decode", "batch"} & set(args.sections):
        llama_cpp.binary("llama-server")  # NotBuilt says how to build it, before any model is written
    out = common.output_dir(args.out, args.quick)
    raw = out / "raw" if not args.quick else out
    machine = common.machine()
    name = f"peers_{args.tag}" if args.tag else "peers"
    results: dict = {}
    for model in args.models:
        paths = peer_models.ensure(model, ["hf", *args.formats], log=lambda m: print(m, file=sys.stderr))
        prompts = PromptMaker(paths["hf"])
        for fmt in args.formats:
            entry = results.setdefault(model, {}).setdefault(fmt, {})
            if "decode" in args.sections:
                rounds = run_decode(paths, fmt, args, prompts, raw)
                entry["decode"] = {name: {n: median_stream(s) for n, s in by.items()} for name, by in rounds.items()}
                entry["decode_rounds"] = rounds
            if "batch" in args.sections:
                entry["batch"] = run_batch(paths, fmt, args.kv_dtypes[0], args, prompts, raw)
        if "long" in args.sections:
            results[model].setdefault("f32", {})["long"] = run_long(paths, args, prompts, raw)
        common.write_json(out / f"{name}.json", {"args": vars(args), "machine": machine, "results": as_json(results)})
    plot_names = plot(results, args, out)
    markdown = report(results, args, machine, plot_names)
    (out / f"{name}.md").write_text(markdown)
    common.write_json(out / f"{name}.json", {"args": vars(args), "machine": machine, "results": as_json(results)})
    print("\n" + markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
