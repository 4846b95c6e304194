"""Prefix caching end to end on the tiny random Llama: with caching on, a mixed workload (shared
prefixes, repeats, chunked prefill, preemption, truncate, n, prompt logprobs, a cancelled stream)
gives the same tokens as with caching off, and as transformers; reuse really happens; no block
is leaked."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from tests.engine_calls import generate_tgi, validated

SYSTEM = "the quick brown fox jumps over a lazy dog and then runs home again while birds sing "
# (prompt, max_new_tokens, extra parameters); several share SYSTEM, some repeat or extend others.
WORKLOAD = [
    (SYSTEM + "café naïve", 12, {}),
    (SYSTEM + "日本語 東京", 20, {}),
    (SYSTEM + "café naïve", 9, {}),  # a repeat: every full block but the last token's is cached
    (SYSTEM * 2 + "Привет мир", 16, {}),
    ("a", 14, {}),
    (SYSTEM + "café naïve résumé Grüße", 18, {"decoder_input_details": True}),  # needs every prompt logit
    (SYSTEM + "1234 3.14 , . ! ?", 10, {"truncate": 12}),
    (SYSTEM, 24, {}),
    (SYSTEM * 2 + "😀 🎉 👍🏽", 8, {}),
    ("birds sing café", 22, {}),
]


def _config(model_dir, prefix_caching: bool, kv_tokens: int, budget: int) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir)),
        cache=CacheConfig(block_size=4, max_batch_total_tokens=kv_tokens, prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_batch_prefill_tokens=budget),
        limits=LimitsConfig(max_concurrent_requests=64),
    )


async def _validate(engine: AsyncEngine, inputs: str, max_new_tokens: int, **parameters):
    return await validated(
        engine,
        GenerateRequest(inputs, GenerateParameters(max_new_tokens=max_new_tokens, details=True, **parameters)),
        stream=False,
    )


async def _cancelled_stream(engine: AsyncEngine) -> None:
    """A request sharing the system prompt, cancelled after its first token."""
    request = await validated(
        engine, GenerateRequest(SYSTEM + "the the", GenerateParameters(max_new_tokens=60)), stream=True
    )
    stream = engine.generate_stream(request)
    async for _output in stream:
        break
    await stream.aclose()


async def _run_workload(model_dir, prefix_caching: bool, kv_tokens: int, budget: int, stagger_s: float):
    engine = AsyncEngine.from_config(_config(model_dir, prefix_caching, kv_tokens, budget))
    engine.start()

    async def one(index: int):
        await asyncio.sleep(stagger_s * index)  # later requests arrive while earlier ones run
        inputs, max_new, parameters = WORKLOAD[index]
        request = await _validate(engine, inputs, max_new, **parameters)
        return request, await engine.generate(request)

    async def variants():  # OpenAI's n: three requests with one prompt, admitted together
        request = await _validate(engine, SYSTEM + "over over", 10)
        return request, await engine.generate_all([request] * 3)

    try:
        *results, (n_request, n_results), _ = await asyncio.gather(
            *(one(i) for i in range(len(WORKLOAD))), variants(), _cancelled_stream(engine)
        )
        for _ in range(100):
            stats = engine.stats()
            if stats.num_running == 0 and stats.num_waiting == 0:
                break
            await asyncio.sleep(0.02)
    finally:
        await engine.shutdown(timeout_s=1)
    assert stats.num_free_blocks == stats.num_total_blocks, "a block leaked"
    outputs = [[t.id for t in result.tokens] for _, result in results]
    outputs += [[t.id for t in result.tokens] for result in n_results]
    prefill = {
        index: [p.logprob for p in result.prefill_tokens]
        for index, (_, result) in enumerate(results)
        if result.prefill_tokens
    }
    requests = [request for request, _ in results] + [n_request] * 3
    return outputs, prefill, requests, stats


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()


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


@pytest.mark.parametrize(
    ("kv_tokens", "budget", "stagger_s", "preempts"),
    [
        (4096, 12, 0.02, False),  # chunked prefill: 12 tokens a step; hits on running requests' blocks
        (192, 48, 0.0, True),  # a pool far smaller than the load: preemption and eviction
    ],
    ids=["chunked-prefill", "preemption"],
)
async def test_caching_on_gives_the_tokens_of_caching_off(
    tiny_model_dir, reference, kv_tokens, budget, stagger_s, preempts
):
    on = await _run_workload(tiny_model_dir, True, kv_tokens, budget, stagger_s)
    off = await _run_workload(tiny_model_dir, False, kv_tokens, budget, stagger_s)
    (outputs_on, prefill_on, requests, stats_on), (outputs_off, prefill_off, _, stats_off) = on, off
    assert outputs_on == outputs_off
    for request, tokens in zip(requests, outputs_on, strict=True):
        assert tokens == _reference_greedy(reference, request.prompt_token_ids, request.stopping.max_new_tokens), (
            request.prompt_token_ids
        )
    assert prefill_on.keys() == prefill_off.keys() == {5}
    assert prefill_on[5][0] is None and prefill_on[5][1:] == pytest.approx(prefill_off[5][1:], abs=1e-5)
    prompt_ids = requests[5].prompt_token_ids
    with torch.inference_mode():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)  # [L, V]
    expected = [logprobs[position - 1, token].item() for position, token in enumerate(prompt_ids) if position]
    assert prefill_on[5][1:] == pytest.approx(expected, abs=1e-4)
    assert stats_on.num_prefix_hit_tokens > 0 and stats_on.num_cached_blocks > 0
    assert stats_off.num_prefix_hit_tokens == 0 and stats_off.num_cached_blocks == 0
    if preempts:
        assert stats_on.num_preemptions > 0 and stats_off.num_preemptions > 0


async def test_n_variants_compute_their_prompt_once(tiny_model_dir):
    engine = AsyncEngine.from_config(_config(tiny_model_dir, True, 4096, 512))
    engine.start()
    try:
        request = await _validate(engine, SYSTEM * 3, 4)
        results = await engine.generate_all([request] * 4)
        stats = engine.stats()
    finally:
        await engine.shutdown(timeout_s=1)
    assert len({tuple(t.id for t in r.tokens) for r in results}) == 1
    num_prompt = len(request.prompt_token_ids)
    reusable = (num_prompt - 1) // 4 * 4
    # The first computes the prompt; the other three wait for it, then reuse every full block.
    assert stats.num_prefix_queried_tokens == 4 * num_prompt
    assert stats.num_prefix_hit_tokens == 3 * reusable


async def test_prompt_logprobs_preempted_mid_prompt_are_recorded_once(tiny_model_dir, reference):
    """A request wanting prompt logprobs reuses nothing, even its own blocks after a preemption, and
    positions it had already recorded are not recorded twice when its prompt is recomputed."""
    engine = AsyncEngine.from_config(_config(tiny_model_dir, True, 4096, 16))  # 16-token chunks
    request = await _validate(engine, SYSTEM, 3, decoder_input_details=True)
    llm = engine._engine  # driven step by step on this thread: the engine thread is never started
    llm.add_request("x", request)
    outputs = llm.step() + llm.step()  # 32 prompt tokens computed and their logprobs recorded
    llm.scheduler._preempt(llm.live["x"].request)  # white box: what a full pool would do
    while llm.has_unfinished():
        outputs += llm.step()
    [prefill] = [o.prefill_tokens for o in outputs if o.prefill_tokens]
    prompt_ids = request.prompt_token_ids
    assert [p.id for p in prefill] == prompt_ids
    with torch.inference_mode():
        logprobs = torch.log_softmax(reference(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)  # [L, V]
    expected = [logprobs[position - 1, token].item() for position, token in enumerate(prompt_ids) if position]
    assert [p.logprob for p in prefill[1:]] == pytest.approx(expected, abs=1e-4)
    assert llm.stats().num_prefix_hit_tokens == 0 and llm.stats().num_preemptions == 1


async def test_best_of_variants_share_their_prompt(tiny_model_dir):
    engine = AsyncEngine.from_config(_config(tiny_model_dir, True, 4096, 512))
    engine.start()
    try:
        result = await generate_tgi(
            engine,
            GenerateRequest(SYSTEM * 2, GenerateParameters(max_new_tokens=6, details=True, best_of=2, do_sample=True)),
        )
        stats = engine.stats()
    finally:
        await engine.shutdown(timeout_s=1)
    assert len(result.best_of_sequences) == 1
    num_prompt = result.num_prompt_tokens
    # The second variant reused the first's: every whole block of the prompt, and where it was admitted
    # after the first's prefill (a busy machine), the partial last block too, all but the last token.
    assert (num_prompt - 1) // 4 * 4 <= stats.num_prefix_hit_tokens <= num_prompt - 1
    assert stats.num_free_blocks == stats.num_total_blocks
