"""LoRA adapters on the demo model (SmolLM2-135M, real weights, fp32): two peft-made adapters with
random non-zero B and the base, arriving staggered into one engine (prompts chunked), give peft's
greedy tokens and logprobs (1e-4) under transformers, row for row (checked along our output in one
teacher-forced pass per row: each token is peft's argmax given the ones before it)."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.models.demo import ensure_demo_model
from tests.engine_calls import idle, validated
from tests.lora_adapters import make_adapter

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
NEW_TOKENS = 10
# Large enough that each adapter changes the demo model's greedy output, small enough to stay a
# plausible fine-tune (the update is a fraction of the base projection's output).
ADAPTER_SCALE = 0.05


def test_demo_model_adapters_equal_peft(tmp_path):
    demo = ensure_demo_model()
    adapters = {
        "alpha": make_adapter(demo, tmp_path / "alpha", seed=21, scale=ADAPTER_SCALE),
        "beta": make_adapter(
            demo,
            tmp_path / "beta",
            seed=22,
            rank=16,
            alpha=8,
            use_rslora=True,
            targets=["q_proj", "v_proj", "down_proj"],
            scale=ADAPTER_SCALE,
        ),
    }
    engine = AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(
                model_id=str(demo),
                dtype="float32",
                lora_adapters=",".join(f"{name}={path}" for name, path in adapters.items()),
            ),
            cache=CacheConfig(max_batch_total_tokens=2048),
            scheduler=SchedulerConfig(max_batch_prefill_tokens=16),  # prompts chunked beside decode rows
            limits=LimitsConfig(max_total_tokens=256),
        )
    )
    engine.start()
    jobs = [(adapter, prompt) for prompt in PROMPTS for adapter in (None, *adapters)]

    async def one(index: int, adapter: str | None, prompt: str):
        await asyncio.sleep(0.05 * index)
        parameters = GenerateParameters(max_new_tokens=NEW_TOKENS, details=True, adapter_id=adapter)
        request = await validated(engine, GenerateRequest(prompt, parameters))
        return adapter, request.prompt_token_ids, await engine.generate(request)

    async def main():
        runs = await asyncio.gather(*(one(i, a, p) for i, (a, p) in enumerate(jobs)))
        stats = await idle(engine)
        await engine.shutdown(5.0)
        return runs, stats

    runs, stats = asyncio.run(main())
    assert stats.num_running == 0
    base = AutoModelForCausalLM.from_pretrained(demo, dtype=torch.float32, attn_implementation="eager").eval()
    references = {None: base}
    references.update(
        {name: PeftModel.from_pretrained(copy.deepcopy(base), path).eval() for name, path in adapters.items()}
    )
    outputs: dict[str | None, set[tuple[int, ...]]] = {}
    for adapter, prompt_ids, result in runs:
        got = [t.id for t in result.tokens]
        assert len(got) == NEW_TOKENS or result.finish_reason.value == "eos_token"
        with torch.inference_mode():  # peft's logits along our output in one pass: each token its argmax
            logits = references[adapter](input_ids=torch.tensor([prompt_ids + got])).logits[0].float()
        logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
        assert got == logprobs.argmax(dim=-1).tolist(), (adapter, result.generated_text)
        expected = logprobs[torch.arange(len(got)), torch.tensor(got)].tolist()
        assert [t.logprob for t in result.tokens] == pytest.approx(expected, abs=1e-4), adapter
        outputs.setdefault(adapter, set()).add(tuple(got))
    for adapter in adapters:  # each adapter really changes what the demo model says
        assert outputs[adapter] != outputs[None], adapter
