"""The engine end to end on a tiny random Llama, checked against transformers as the reference."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.errors import GenerationError, OverloadedError, RequestCancelled, UnavailableError
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from tests.engine_calls import generate_tgi, validated

PROMPTS = [
    "the quick brown fox",
    "café naïve résumé Grüße and then runs home again while birds sing",
    "日本語",
    "a",
    "over a lazy dog and then runs home again while birds sing the quick brown fox jumps over",
    "Привет мир ¿Qué? 😀 🎉",
    "1234 3.14 , . ! ?",
    "birds sing café",
    "the the the the the the",
    "東京 こんにちは 世界 中文 the quick",
]


def _config(model_dir, kv_tokens: int = 4096, max_concurrent: int = 64, **scheduler) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir)),
        cache=CacheConfig(block_size=4, max_batch_total_tokens=kv_tokens),
        scheduler=SchedulerConfig(**scheduler),
        limits=LimitsConfig(max_concurrent_requests=max_concurrent),
    )


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _reference_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=model.config.eos_token_id,
            pad_token_id=model.config.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


async def _run(engine: AsyncEngine, inputs: str, **parameters):
    request = await validated(
        engine, GenerateRequest(inputs=inputs, parameters=GenerateParameters(**parameters)), stream=False
    )
    return request, await engine.generate(request)


@pytest.fixture
def make_engine(tiny_model_dir):
    engines: list[AsyncEngine] = []

    def make(**scheduler) -> AsyncEngine:
        engine = AsyncEngine.from_config(_config(tiny_model_dir, **scheduler))
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        asyncio.run(engine.shutdown(timeout_s=1))


async def _staggered_greedy(engine: AsyncEngine, reference, lengths: list[int], stagger_s: float = 0.03) -> None:
    async def one(index: int):
        await asyncio.sleep(stagger_s * index)  # arrive while earlier requests decode
        return await _run(engine, PROMPTS[index], max_new_tokens=lengths[index], details=True)

    results = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    for (request, result), max_new in zip(results, lengths, strict=True):
        expected = _reference_greedy(reference, request.prompt_token_ids, max_new)
        assert [t.id for t in result.tokens] == expected, request.prompt_token_ids
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


async def test_greedy_matches_transformers_generate_with_staggered_arrivals(make_engine, reference):
    engine = make_engine(max_batch_prefill_tokens=12)  # small budget: prompts are prefilled in chunks
    await _staggered_greedy(engine, reference, [24, 9, 30, 17, 5, 40, 12, 21, 33, 8])
    assert engine.stats().num_steps > 40


async def test_preempted_requests_are_recomputed_and_still_exact(make_engine, reference):
    engine = make_engine(kv_tokens=160, max_batch_prefill_tokens=64)  # far fewer slots than the load
    # All at once: with arrivals spread in time, a fast engine could finish early requests before
    # late ones come, and never run out of blocks.
    await _staggered_greedy(engine, reference, [40, 38, 36, 34, 32, 30, 28, 26, 24, 22], stagger_s=0.0)
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("budget", [None, 5], ids=["whole-prompt", "chunked-prompt"])
async def test_logprobs_and_prompt_logprobs_equal_reference_log_softmax(make_engine, reference, budget):
    engine = make_engine(max_batch_prefill_tokens=budget) if budget else make_engine()
    request, result = await _run(
        engine, PROMPTS[1], max_new_tokens=6, details=True, decoder_input_details=True, top_n_tokens=3
    )
    ids = request.prompt_token_ids + [t.id for t in result.tokens]
    with torch.inference_mode():
        logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, V]
    num_prompt = len(request.prompt_token_ids)
    assert result.prefill_tokens[0].logprob is None and result.prefill_tokens[0].top_tokens == []
    assert [p.id for p in result.prefill_tokens] == request.prompt_token_ids
    for position, token in enumerate(result.prefill_tokens[1:], start=1):
        assert token.logprob == pytest.approx(logprobs[position - 1, token.id].item(), abs=1e-4)
        expected_top = torch.topk(logprobs[position - 1], 3)  # the prompt's alternatives too (OpenAI's echo)
        assert [t.id for t in token.top_tokens] == expected_top.indices.tolist()
        assert [t.logprob for t in token.top_tokens] == pytest.approx(expected_top.values.tolist(), abs=1e-4)
    for offset, (token, top) in enumerate(zip(result.tokens, result.top_tokens, strict=True)):
        row = logprobs[num_prompt - 1 + offset]
        assert token.logprob == pytest.approx(row[token.id].item(), abs=1e-4)
        expected_top = torch.topk(row, 3)
        assert [t.id for t in top] == expected_top.indices.tolist()
        assert [t.logprob for t in top] == pytest.approx(expected_top.values.tolist(), abs=1e-4)


async def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(make_engine):
    engine = make_engine()
    params = dict(max_new_tokens=20, do_sample=True, temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    _, alone = await _run(engine, PROMPTS[0], **params)
    noise = [_run(engine, PROMPTS[i], max_new_tokens=25, do_sample=True, temperature=1.3) for i in range(2, 8)]
    results = await asyncio.gather(*noise, _run(engine, PROMPTS[0], **params))
    _, busy = results[-1]
    assert [t.id for t in busy.tokens] == [t.id for t in alone.tokens]
    assert busy.seed == 1234


async def test_cancelling_a_stream_frees_its_blocks_and_others_go_on(make_engine):
    engine = make_engine()
    request = await validated(engine, GenerateRequest(PROMPTS[4], GenerateParameters(max_new_tokens=200)), stream=True)
    other = asyncio.create_task(_run(engine, PROMPTS[0], max_new_tokens=30))
    stream = engine.generate_stream(request)
    async for _output in stream:
        break
    await stream.aclose()
    _, result = await other
    assert result.finish_reason is not None and result.num_generated_tokens > 0
    for _ in range(100):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks:
            break
        await asyncio.sleep(0.02)
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


async def test_error_inside_one_request_ends_only_that_request(make_engine, monkeypatch):
    engine = make_engine()
    from inference_service.engine import detokenizer

    bad = await validated(engine, GenerateRequest(PROMPTS[2], GenerateParameters(max_new_tokens=20)), stream=False)
    original_init, original_add = detokenizer.TextState.__init__, detokenizer.TextState.add

    def marking_init(self, tokenizer, prompt_token_ids, *args, **kwargs):
        original_init(self, tokenizer, prompt_token_ids, *args, **kwargs)
        self.inject_failure = list(prompt_token_ids) == bad.prompt_token_ids

    def failing_add(self, token_id, special):  # fault injection into one request's text handling
        if self.inject_failure and self.num_tokens == 3:
            raise ValueError("injected failure")
        return original_add(self, token_id, special)

    monkeypatch.setattr(detokenizer.TextState, "__init__", marking_init)
    monkeypatch.setattr(detokenizer.TextState, "add", failing_add)
    good_task = asyncio.create_task(_run(engine, PROMPTS[3], max_new_tokens=20))
    with pytest.raises(GenerationError, match="processing the sampled token failed for this request") as failed:
        await engine.generate(bad)
    assert "injected" not in failed.value.message and "ValueError" not in failed.value.message  # in the log only
    _, good = await good_task
    assert good.finish_reason is not None and good.num_generated_tokens > 3
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_best_of_returns_the_best_mean_logprob(make_engine):
    engine = make_engine()
    result = await generate_tgi(
        engine,
        GenerateRequest(PROMPTS[0], GenerateParameters(max_new_tokens=8, best_of=2, do_sample=True, details=True)),
    )
    assert len(result.best_of_sequences) == 1
    mean = sum(t.logprob for t in result.tokens) / len(result.tokens)
    loser = result.best_of_sequences[0]
    assert mean >= sum(t.logprob for t in loser.tokens) / len(loser.tokens)
    assert result.seed is not None and loser.seed is not None and result.seed != loser.seed


async def test_stop_sequence_ends_generation_and_stays_in_text(make_engine, reference):
    engine = make_engine()
    request, free_run = await _run(engine, PROMPTS[0], max_new_tokens=12)
    stop = free_run.generated_text[3:6]
    if not stop.strip():
        pytest.skip("the random model produced only blanks here")  # pragma: no cover
    _, stopped = await _run(engine, PROMPTS[0], max_new_tokens=12, stop=[stop])
    assert stopped.finish_reason.value == "stop_sequence"
    assert stopped.generated_text.endswith(stop)
    assert free_run.generated_text.startswith(stopped.generated_text)


async def test_overload_beyond_max_concurrent_requests(tiny_model_dir):
    engine = AsyncEngine.from_config(_config(tiny_model_dir, max_concurrent=1))
    engine.start()
    try:
        request = await validated(
            engine, GenerateRequest(PROMPTS[0], GenerateParameters(max_new_tokens=50)), stream=True
        )
        first = engine.generate_stream(request)
        await first.__anext__()
        with pytest.raises(OverloadedError):
            await engine.generate(request)
        await first.aclose()
    finally:
        await engine.shutdown(timeout_s=1)


async def test_shutdown_cancels_what_does_not_finish_in_time(tiny_model_dir):
    engine = AsyncEngine.from_config(_config(tiny_model_dir))
    engine.start()
    request = await validated(engine, GenerateRequest(PROMPTS[0], GenerateParameters(max_new_tokens=400)), stream=True)
    request = dataclasses.replace(request, stopping=dataclasses.replace(request.stopping, ignore_eos=True))
    stream = engine.generate_stream(request)
    await stream.__anext__()
    await engine.shutdown(timeout_s=0)
    with pytest.raises(RequestCancelled):
        async for _output in stream:
            pass
    with pytest.raises(UnavailableError):
        await engine.generate(request)
