"""Calling an `AsyncEngine` directly in tests: requests through the front end as served, one
validated generation, and waiting until idle."""

from __future__ import annotations

import asyncio

from inference_service.api.tgi import best_of
from inference_service.engine.async_engine import AsyncEngine
from inference_service.frontend.front_end import FrontEnd
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.outputs import GenerateResult
from inference_service.sampling_params import EngineRequest


async def validated(engine: AsyncEngine, request: GenerateRequest, *, stream: bool = False) -> EngineRequest:
    """The engine's request for a TGI-shaped request, through the front end as TGI's routes call it."""
    return (await FrontEnd.for_engine(engine).validate(request, stream=stream)).engine_request


async def generate_tgi(engine: AsyncEngine, request: GenerateRequest) -> GenerateResult:
    """A unary generation as TGI's `Generate` runs it (`best_of` included)."""
    front_end = FrontEnd.for_engine(engine)
    checked = await front_end.validate(request, stream=False)
    return best_of(await engine.generate_all(front_end.best_of_variants(checked)))


async def generate(engine: AsyncEngine, inputs: str, max_new_tokens: int, **parameters):
    """(engine request, result) of one unary generation with details."""
    request = await validated(
        engine, GenerateRequest(inputs, GenerateParameters(max_new_tokens=max_new_tokens, details=True, **parameters))
    )
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
    together = await asyncio.gather(
        generate(engine, "the quick brown fox", 15, **seeded),
        generate(engine, "a", 25),
        generate(engine, "café", 9, do_sample=True),
    )
    request = await validated(engine, GenerateRequest("a", GenerateParameters(max_new_tokens=60)), stream=True)
    stream = engine.generate_stream(request)
    async for _output in stream:
        break
    await stream.aclose()
    return [t.id for t in alone.tokens], [t.id for t in together[0][1].tokens]
