"""Calling an `AsyncEngine` directly in tests: one validated generation, and waiting until idle."""

from __future__ import annotations

import asyncio

from inference_service.engine.async_engine import AsyncEngine
from inference_service.engine.validation import GenerateParameters, GenerateRequest


async def generate(engine: AsyncEngine, inputs: str, max_new_tokens: int, **parameters):
    """(validated request, result) of one unary generation with details."""
    request = await engine.validate(GenerateRequest(inputs, GenerateParameters(
        max_new_tokens=max_new_tokens, details=True, **parameters)), stream=False)
    return request, await engine.generate(request)


async def idle(engine: AsyncEngine):
    """The engine's stats once nothing runs or waits (cancelled streams end asynchronously)."""
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == stats.num_waiting == 0:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError("not idle")


async def seeded_alone_and_among_others(engine: AsyncEngine):
    """(tokens of a seeded request run alone, the same request's among other requests), then a
    stream cancelled after its first output (the caller checks nothing was left behind)."""
    seeded = {"do_sample": True, "seed": 5, "temperature": 0.9, "top_k": 40}
    _, alone = await generate(engine, "the quick brown fox", 15, **seeded)
    together = await asyncio.gather(generate(engine, "the quick brown fox", 15, **seeded),
                                    generate(engine, "a", 25), generate(engine, "café", 9, do_sample=True))
    request = await engine.validate(GenerateRequest("a", GenerateParameters(max_new_tokens=60)), stream=True)
    stream = engine.generate_stream(request)
    async for _output in stream:
        break
    await stream.aclose()
    return [t.id for t in alone.tokens], [t.id for t in together[0][1].tokens]
