"""Prefix caching on the real demo model (SmolLM2-135M-Instruct, fp32): chat turns sharing a
system prompt, with chunked prefill and a KV pool small enough to preempt, give the same greedy
tokens with caching on as with caching off."""

from __future__ import annotations

import asyncio

import pytest

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.models.demo import ensure_demo_model
from tests.engine_calls import validated

pytestmark = pytest.mark.slow

SYSTEM = (
    "<|im_start|>system\nYou are a careful assistant for a small bakery. You answer questions about "
    "opening hours (Monday to Friday 7am to 6pm, Saturday 8am to 2pm, closed on Sunday), the daily "
    "bread (sourdough, rye, baguette, whole wheat), pastries (croissants, pain au chocolat, cinnamon "
    "rolls) and custom cakes, which must be ordered three days ahead. Keep answers short and "
    "friendly, and never invent prices.<|im_end|>\n"
)
QUESTIONS = [
    "When are you open on Saturday?",
    "Do you sell rye bread?",
    "Can I order a cake for tomorrow?",
    "What pastries do you have?",
    "When are you open on Saturday?",
    "Are you open on Sunday?",
]
LENGTHS = [24, 18, 30, 20, 12, 26]


def _prompt(question: str) -> str:
    return f"{SYSTEM}<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


async def _run(demo_dir, prefix_caching: bool):
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(model_id=str(demo_dir), dtype="float32"),
            cache=CacheConfig(max_batch_total_tokens=192, prefix_caching=prefix_caching),  # 12 blocks of 16
            scheduler=SchedulerConfig(max_batch_prefill_tokens=48),  # the system prompt takes several steps
            limits=LimitsConfig(max_total_tokens=192),
        )
    )
    engine.start()

    async def one(index: int):
        await asyncio.sleep(0.3 * (index % 3))  # some arrive while others prefill or decode
        request = await validated(
            engine,
            GenerateRequest(_prompt(QUESTIONS[index]), GenerateParameters(max_new_tokens=LENGTHS[index], details=True)),
            stream=False,
        )
        result = await engine.generate(request)
        return [t.id for t in result.tokens]

    try:
        outputs = await asyncio.gather(*(one(i) for i in range(len(QUESTIONS))))
        stats = engine.stats()
    finally:
        await engine.shutdown(timeout_s=1)
    return outputs, stats


async def test_demo_model_tokens_are_the_same_with_caching_on_and_off():
    demo_dir = ensure_demo_model()
    outputs_on, stats_on = await _run(demo_dir, True)
    outputs_off, stats_off = await _run(demo_dir, False)
    assert outputs_on == outputs_off
    assert stats_on.num_prefix_hit_tokens > 0
    assert stats_on.num_preemptions > 0 and stats_off.num_preemptions > 0
    assert stats_on.num_free_blocks == stats_on.num_total_blocks
