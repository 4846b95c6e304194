"""The engine on the real demo model (SmolLM2-135M-Instruct, fp32): token-identical to transformers."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import EngineConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.models.demo import ensure_demo_model
from tests.engine_calls import validated

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time",
    "In 2018 there were 12345 cats.",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Here is a list of fruits: apple, banana,",
    "import numpy as np\n\narr = np.",
]


@pytest.fixture(scope="module")
def demo_dir():
    return ensure_demo_model()


async def test_demo_model_greedy_matches_transformers_with_staggered_arrivals(demo_dir):
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(model_id=str(demo_dir), dtype="float32"),
            scheduler=SchedulerConfig(max_batch_prefill_tokens=16),
        )
    )  # chunked prefill of the longer prompts
    engine.start()
    lengths = [20, 12, 16, 24, 10, 18, 14, 22, 12]

    async def one(index: int):
        await asyncio.sleep(0.15 * index)  # arrive while the earlier ones decode
        request = await validated(
            engine,
            GenerateRequest(PROMPTS[index], GenerateParameters(max_new_tokens=lengths[index], details=True)),
            stream=False,
        )
        return request, await engine.generate(request)

    try:
        results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    finally:
        await engine.shutdown(timeout_s=1)
    reference = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    for prompt, (request, result) in zip(PROMPTS, results, strict=True):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([request.prompt_token_ids]),
                do_sample=False,
                max_new_tokens=request.stopping.max_new_tokens,
            )
        expected = out[0, len(request.prompt_token_ids) :].tolist()
        assert [t.id for t in result.tokens] == expected, prompt
    paris = results[0][1]  # PROMPTS[0]: gather keeps the order
    assert paris.generated_text.lstrip().startswith("Paris")
