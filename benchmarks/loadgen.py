"""The load generator: streaming requests over gRPC (the project's `textgen_client`) and over REST
(`/generate_stream` through Envoy, read as SSE with aiohttp), driven closed-loop (a fixed number of
concurrent users), open-loop (Poisson arrivals, whatever the server's pace) or as one burst.

Every request records when it was sent, when each token arrived and how it ended; overload
(gRPC RESOURCE_EXHAUSTED, HTTP 429, or TGI's in-band `overloaded` SSE event) is told apart from
every other error, since only overload is acceptable, and only past the admission limit.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from benchmarks import common
from textgen_client import AsyncClient, OverloadedError, RetryPolicy, TextGenerationError

OVERLOADED = "overloaded"

# Plain English to cut prompts from; each request gets its own shuffle, so no two prompts are equal.
SENTENCES = (
    "The river rose after three days of rain and the old bridge was closed to traffic.",
    "Engineers measured the load on each pillar before they allowed the first trucks across.",
    "A small bakery on the corner sells bread that is still warm at six in the morning.",
    "Most of the town's children learn to swim in the lake during the long summer holidays.",
    "The library keeps a collection of maps that show how the coastline changed over centuries.",
    "When the wind turns north, the fishing boats stay in the harbour until the sea calms down.",
    "Her grandfather built the clock tower and repaired its gears by hand for forty years.",
    "Tourists often ask why the streets are so narrow, and the answer lies in the medieval walls.",
    "The football club trains on a field that floods every spring, so they play on sand instead.",
    "Scientists from the university count the birds that nest on the cliffs every June.",
    "An early train leaves for the capital at five, and it is usually full of students.",
    "The market square fills with stalls of cheese, honey, vegetables and hand-made baskets.",
    "During the winter festival the whole valley is lit with lanterns and candles.",
    "Few people remember that the castle once served as a hospital during a long war.",
    "The new school has solar panels on its roof and a garden where pupils grow tomatoes.",
    "Every evening the lighthouse keeper writes the weather and the passing ships in a log.",
)


@dataclass
class RequestRecord:
    """One request as the client saw it; times are `time.perf_counter()` seconds."""

    start: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    error: str | None = None  # None, OVERLOADED, or a short description of any other failure

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def inter_token(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


@dataclass(frozen=True)
class Prompts:
    """Prompts of exactly `prompt_tokens` tokens (`truncate` keeps the last ones), `max_new_tokens` each."""

    prompt_tokens: int
    max_new_tokens: int
    seed: int = 0

    def text(self, index: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + index)
        sentences: list[str] = []
        while sum(len(s) for s in sentences) < 8 * self.prompt_tokens:  # >= 1 token per 8 characters
            sentences.extend(rng.sample(SENTENCES, len(SENTENCES)))
        return " ".join(sentences)


class GrpcTarget:
    """Streams over one gRPC channel (HTTP/2 multiplexes every call), no client retries."""

    name = "grpc"

    def __init__(self, target: str, timeout_s: float):
        self.client = AsyncClient(target, timeout=timeout_s, retry=RetryPolicy(max_retries=0))

    async def stream(self, prompts: Prompts, index: int, record: RequestRecord) -> None:
        try:
            async for _response in self.client.generate_stream(
                prompts.text(index),
                max_new_tokens=prompts.max_new_tokens,
                truncate=prompts.prompt_tokens,
                details=False,
            ):
                record.token_times.append(time.perf_counter())
        except OverloadedError:
            record.error = OVERLOADED
        except TextGenerationError as error:
            record.error = f"{type(error).__name__}: {error}"[:200]

    async def close(self) -> None:
        await self.client.close()


class RestTarget:
    """`POST /generate_stream` through Envoy, one keep-alive connection per concurrent request."""

    name = "rest"

    def __init__(self, url: str, timeout_s: float):
        self.url = url.rstrip("/") + "/generate_stream"
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout_s)
        )

    async def stream(self, prompts: Prompts, index: int, record: RequestRecord) -> None:
        body = {
            "inputs": prompts.text(index),
            "parameters": {"max_new_tokens": prompts.max_new_tokens, "truncate": prompts.prompt_tokens},
        }
        try:
            async with self.session.post(self.url, json=body) as response:
                if response.status != 200:
                    text = await response.text()
                    record.error = OVERLOADED if response.status == 429 else f"HTTP {response.status}: {text[:150]}"
                    return
                async for line in response.content:
                    if not line.startswith(b"data:"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        kind = event.get("error_type")
                        record.error = OVERLOADED if kind == OVERLOADED else f"{kind}: {event['error']}"[:200]
                        return
                    record.token_times.append(time.perf_counter())
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as error:
            record.error = f"{type(error).__name__}: {error}"[:200]

    async def close(self) -> None:
        await self.session.close()


Target = GrpcTarget | RestTarget
Send = Callable[[int], Awaitable[RequestRecord]]


class Sender:
    """Sends request `index` to a target and keeps count of what is in flight."""

    def __init__(self, target: Target, prompts: Prompts, on_done: Callable[[], None] = lambda: None):
        self.target = target
        self.prompts = prompts
        self.in_flight = 0
        self.max_in_flight = 0
        self._on_done = on_done

    async def __call__(self, index: int) -> RequestRecord:
        record = RequestRecord(start=time.perf_counter())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.target.stream(self.prompts, index, record)
        finally:
            self.in_flight -= 1
            record.end = time.perf_counter()
            self._on_done()
        if record.error is None and len(record.token_times) == 0:
            record.error = "no tokens"
        return record


async def closed_loop(send: Send, concurrency: int, max_requests: int, duration_s: float) -> list[RequestRecord]:
    """`concurrency` users, each sending its next request when the last one ended, until
    `max_requests` were sent or `duration_s` passed (requests in flight then are awaited)."""
    records: list[RequestRecord] = []
    deadline = time.perf_counter() + duration_s
    next_index = 0

    async def user() -> None:
        nonlocal next_index
        while next_index < max_requests and time.perf_counter() < deadline:
            index, next_index = next_index, next_index + 1
            records.append(await send(index))

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return records


async def open_loop(
    send: Send, rate: float, max_requests: int, duration_s: float, seed: int = 0
) -> list[RequestRecord]:
    """Poisson arrivals at `rate` per second (the first at once), whatever the server's pace, until
    `max_requests` were sent or `duration_s` passed."""
    rng = random.Random(seed)
    start = time.perf_counter()
    offset = 0.0
    tasks: list[asyncio.Task] = []
    for index in range(max_requests):
        if index:
            offset += rng.expovariate(rate)
        if offset > duration_s:
            break
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(send(index)))
    return list(await asyncio.gather(*tasks))


async def burst(send: Send, num_requests: int) -> list[RequestRecord]:
    """Everything at once: past the admission limit the server must answer overload, nothing else."""
    return list(await asyncio.gather(*(send(index) for index in range(num_requests))))


def summarize(records: list[RequestRecord]) -> dict:
    """Latency percentiles of the successful requests, throughput over the level's wall time, errors."""
    ok = [r for r in records if r.error is None]
    wall = (max(r.end for r in records) - min(r.start for r in records)) if records else float("nan")
    num_tokens = sum(len(r.token_times) for r in ok)
    other_errors = sorted({r.error for r in records if r.error not in (None, OVERLOADED)})
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_overloaded": sum(r.error == OVERLOADED for r in records),
        "num_other_errors": sum(r.error not in (None, OVERLOADED) for r in records),
        "other_errors": other_errors[:5],
        "wall_s": wall,
        "request_throughput": len(ok) / wall if wall else float("nan"),
        "token_throughput": num_tokens / wall if wall else float("nan"),
        "tokens_per_request": num_tokens / len(ok) if ok else float("nan"),
        "ttft_ms": common.summarize([r.ttft * 1000 for r in ok]),
        "itl_ms": common.summarize([gap * 1000 for r in ok for gap in r.inter_token]),
        "e2e_s": common.summarize([r.end - r.start for r in ok]),
    }
