"""The architectures the paged attention can't serve (BLOOM's ALiBi, Falcon, GPT-J, MPT) run through
the fallback runner: transformers' own attention, one cache per request, the same scheduler,
sampler and outputs. Per family, on a tiny random config: greedy output equals transformers'
`generate` with staggered arrivals and mixed lengths, seeded sampling does not depend on batch
neighbours, logprobs equal `log_softmax` within 1e-4, guesses (--speculate) change nothing, and a
cancelled stream leaves no block and no cache behind. `Info` says which path serves."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from tests.engine_calls import generate, idle, seeded_alone_and_among_others
from tests.unit.tiny_models import tiny_config

FAMILIES = ["bloom", "falcon", "gptj", "mpt"]
PROMPTS = [("the quick brown fox", 12), ("a", 20), ("jumps over the lazy dog and runs home", 7), ("café naïve", 16)]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory, byte_tokenizer):
    config = tiny_config(
        request.param,
        vocab_size=len(byte_tokenizer),
        bos_token_id=byte_tokenizer.bos_token_id,
        eos_token_id=byte_tokenizer.eos_token_id,
        pad_token_id=byte_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    byte_tokenizer.save_pretrained(folder)
    return folder


def _engine(folder, speculate: int = 0) -> AsyncEngine:
    return AsyncEngine.from_config(
        EngineConfig(
            model=ModelConfig(model_id=str(folder)),
            cache=CacheConfig(block_size=4, max_batch_total_tokens=2048),
            scheduler=SchedulerConfig(max_batch_prefill_tokens=8, speculate=speculate),  # chunked prompts
            limits=LimitsConfig(max_total_tokens=128),
        )
    )


async def test_greedy_equals_transformers_with_staggered_arrivals(family_dir):
    reference = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()
    for speculate in (0, 3):
        engine = _engine(family_dir, speculate)
        engine.start()
        try:
            info = engine.info
            assert (info.attention_impl, info.prefix_caching) == ("transformers", False)

            async def one(index: int, running: AsyncEngine):
                await asyncio.sleep(0.01 * index)  # later ones join a running batch
                return await generate(running, *PROMPTS[index])

            results = await asyncio.gather(*(one(i, engine) for i in range(len(PROMPTS))))
            stats = await idle(engine)
        finally:
            await engine.shutdown(timeout_s=1)
        assert stats.num_free_blocks == stats.num_total_blocks and engine._engine.runner.num_caches == 0
        for request, result in results:
            with torch.inference_mode():
                out = reference.generate(
                    torch.tensor([request.prompt_token_ids]),
                    do_sample=False,
                    max_new_tokens=request.stopping.max_new_tokens,
                    eos_token_id=reference.config.eos_token_id,
                    pad_token_id=reference.config.eos_token_id,
                )
            assert [t.id for t in result.tokens] == out[0, len(request.prompt_token_ids) :].tolist(), (
                request.prompt_token_ids
            )
            # Each logprob is log_softmax of transformers' logits after the tokens before it.
            ids = request.prompt_token_ids + [t.id for t in result.tokens]
            with torch.inference_mode():
                logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
            start = len(request.prompt_token_ids) - 1
            expected = [logprobs[start + i, t.id].item() for i, t in enumerate(result.tokens)]
            assert [t.logprob for t in result.tokens] == pytest.approx(expected, abs=1e-4)


async def test_seeded_sampling_ignores_its_neighbours_and_cancel_leaves_nothing(family_dir):
    engine = _engine(family_dir)
    engine.start()
    try:
        alone, together = await seeded_alone_and_among_others(engine)
        stats = await idle(engine)
    finally:
        await engine.shutdown(timeout_s=1)
    assert together == alone
    assert stats.num_free_blocks == stats.num_total_blocks and engine._engine.runner.num_caches == 0


async def test_a_model_that_fails_the_probe_is_served_by_the_fallback(tmp_path, byte_tokenizer, monkeypatch):
    """Not known in advance: the probe finds the paged attention can't serve it (BLOOM never calls
    it), and it is served through transformers' attention instead of being refused, exactly."""
    from inference_service.models import registry

    config = tiny_config(
        "bloom",
        vocab_size=len(byte_tokenizer),
        bos_token_id=byte_tokenizer.bos_token_id,
        eos_token_id=byte_tokenizer.eos_token_id,
        pad_token_id=byte_tokenizer.pad_token_id,
    )
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reference.save_pretrained(tmp_path)
    byte_tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(registry, "FALLBACK_ARCHITECTURES", {})
    engine = _engine(tmp_path)
    engine.start()
    try:
        assert engine.info.attention_impl == "transformers"
        request, result = await generate(engine, "the quick brown fox", 10)
    finally:
        await engine.shutdown(timeout_s=1)
    with torch.inference_mode():
        out = reference.generate(
            torch.tensor([request.prompt_token_ids]),
            do_sample=False,
            max_new_tokens=10,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.eos_token_id,
        )
    assert [t.id for t in result.tokens] == out[0, len(request.prompt_token_ids) :].tolist()
