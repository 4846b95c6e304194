"""Speculative decoding (`--speculate`) end to end on the tiny random Llama: a mixed workload gives
the tokens, logprobs, texts and finish reasons of plain decoding (greedy and seeded sampling,
penalties, stop sequences, top-n tokens, a grammar, a cancelled stream); guesses are really
accepted; no block is leaked; and speculative sampling draws from the model's distribution."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference_service.config import CacheConfig, EngineConfig, LimitsConfig, ModelConfig, SchedulerConfig
from inference_service.engine.async_engine import AsyncEngine
from inference_service.frontend.parameters import GenerateParameters, GenerateRequest
from inference_service.sample.ngram_proposer import NgramProposer
from tests.engine_calls import validated

ECHO = "the quick brown fox jumps over a lazy dog "
LOOP = "1234 3.14 , . ! ? " * 3  # the tiny model answers with one token over and over: guesses hit
# (prompt, max_new_tokens, extra parameters): repetitive prompts (guesses hit) and plain ones.
WORKLOAD = [
    (ECHO * 3, 40, {}),
    (ECHO + "café naïve " * 4, 33, {"top_n_tokens": 3}),
    ("a", 30, {}),
    (ECHO * 2, 25, {"stop": ["dog", "~"]}),
    (LOOP, 37, {"repetition_penalty": 1.3, "frequency_penalty": 0.4}),
    (LOOP, 30, {"stop": ["\x00" * 7]}),  # the stop sequence ends a run of accepted guesses
    (LOOP, 3, {}),  # max_new_tokens cuts a run of accepted guesses
    (ECHO * 3, 28, {"do_sample": True, "seed": 7, "temperature": 0.7}),
    ("日本語 東京 " * 5, 36, {"do_sample": True, "seed": 11, "top_k": 20, "top_p": 0.9}),
    (ECHO, 31, {"decoder_input_details": True}),
    (ECHO * 2, 24, {"grammar": {"type": "regex", "value": "(fox |dog |the ){4,12}"}}),
    ("birds sing " * 6, 29, {"do_sample": True, "seed": 3, "watermark": True}),
]


STATS_PROMPT = LOOP + "\x00" * 4


def _config(
    model_dir, speculate: int, kv_tokens: int = 4096, budget: int = 64, max_batch_size: int | None = None
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model_id=str(model_dir)),
        cache=CacheConfig(block_size=4, max_batch_total_tokens=kv_tokens),
        scheduler=SchedulerConfig(max_batch_prefill_tokens=budget, speculate=speculate, max_batch_size=max_batch_size),
        limits=LimitsConfig(max_concurrent_requests=2048),
    )


async def _cancelled_stream(engine: AsyncEngine) -> None:
    request = await validated(engine, GenerateRequest(ECHO * 3, GenerateParameters(max_new_tokens=60)), stream=True)
    stream = engine.generate_stream(request)
    async for _output in stream:
        break
    await stream.aclose()


async def _wait_idle(engine: AsyncEngine):
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        await asyncio.sleep(0.02)
    raise AssertionError("the engine did not go idle")


async def _run_workload(model_dir, speculate: int, kv_tokens: int, budget: int, stagger_s: float):
    engine = AsyncEngine.from_config(_config(model_dir, speculate, kv_tokens, budget))
    engine.start()

    async def one(index: int):
        await asyncio.sleep(stagger_s * index)  # later requests join a running batch
        inputs, max_new, parameters = WORKLOAD[index]
        request = await validated(
            engine,
            GenerateRequest(inputs, GenerateParameters(max_new_tokens=max_new, details=True, **parameters)),
            stream=False,
        )
        return await engine.generate(request)

    try:
        *results, _ = await asyncio.gather(*(one(i) for i in range(len(WORKLOAD))), _cancelled_stream(engine))
        stats = await _wait_idle(engine)
    finally:
        await engine.shutdown(timeout_s=1)
    assert stats.num_free_blocks == stats.num_total_blocks, "a block leaked"
    return results, stats


@pytest.mark.parametrize(
    ("kv_tokens", "budget", "stagger_s"),
    [
        (4096, 64, 0.01),  # room for every guess; requests join while others decode
        (4096, 9, 0.0),  # a step budget smaller than the batch's guesses: some are dropped
        (192, 64, 0.0),  # a pool far smaller than the load: preemption, guesses dropped for lack of blocks
    ],
    ids=["roomy", "small-budget", "preemption"],
)
async def test_speculative_outputs_equal_plain_decoding(tiny_model_dir, kv_tokens, budget, stagger_s):
    speculative, stats = await _run_workload(tiny_model_dir, 4, kv_tokens, budget, stagger_s)
    plain, plain_stats = await _run_workload(tiny_model_dir, 0, kv_tokens, budget, stagger_s)
    assert plain_stats.num_draft_tokens == 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, "no guess was accepted"
    for (inputs, _, _), got, want in zip(WORKLOAD, speculative, plain, strict=True):
        assert [t.id for t in got.tokens] == [t.id for t in want.tokens], inputs
        assert [t.logprob for t in got.tokens] == pytest.approx([t.logprob for t in want.tokens], abs=1e-4)
        assert [[t.id for t in top] for top in got.top_tokens] == [[t.id for t in top] for top in want.top_tokens]
        assert (got.generated_text, got.finish_reason, got.num_generated_tokens, got.seed) == (
            want.generated_text,
            want.finish_reason,
            want.num_generated_tokens,
            want.seed,
        )
        assert [p.id for p in got.prefill_tokens] == [p.id for p in want.prefill_tokens]
    assert speculative[3].finish_reason == speculative[5].finish_reason == "stop_sequence"
    assert speculative[5].num_generated_tokens == 7 and speculative[6].num_generated_tokens == 3


async def test_accepted_guesses_save_steps(tiny_model_dir):
    """An answer that repeats itself: most tokens are accepted guesses, so the steps are far fewer."""

    async def steps(speculate: int) -> tuple[list[int], int, float]:
        engine = AsyncEngine.from_config(_config(tiny_model_dir, speculate))
        engine.start()
        try:
            request = await validated(
                engine, GenerateRequest(LOOP, GenerateParameters(max_new_tokens=60)), stream=False
            )
            before = engine.stats().num_steps
            result = await engine.generate(request)
            stats = await _wait_idle(engine)
        finally:
            await engine.shutdown(timeout_s=1)
        return [t.id for t in result.tokens], stats.num_steps - before, stats.speculation_acceptance_rate

    tokens, num_steps, acceptance = await steps(4)
    plain_tokens, plain_steps, _ = await steps(0)
    assert tokens == plain_tokens
    assert plain_steps == 60 and num_steps < 30, (num_steps, acceptance)


async def test_speculative_sampling_keeps_the_distribution(tiny_model_dir):
    """A prompt's first token comes from its prefill; the second from the decode row, the third
    from the verification row of the guess when the second equals it. Over many seeds, with the
    first token fixed to its likeliest value, the second's and third's frequencies fit the model's
    own conditional distributions (transformers' logits; chi-square goodness of fit; fixed seeds,
    so the test is deterministic)."""
    temperature, samples = 0.2, 2000  # the guesses get about half the mass
    # At most 16 running at once: above that nobody guesses (engine/speculation.py).
    engine = AsyncEngine.from_config(_config(tiny_model_dir, 4, kv_tokens=65536, budget=8192, max_batch_size=16))
    engine.start()
    try:
        requests = [
            await validated(
                engine,
                GenerateRequest(
                    STATS_PROMPT,
                    GenerateParameters(max_new_tokens=3, do_sample=True, seed=seed, temperature=temperature),
                ),
                stream=False,
            )
            for seed in range(samples)
        ]
        results = await engine.generate_all(requests)
        stats = await _wait_idle(engine)
    finally:
        await engine.shutdown(timeout_s=1)
    prompt_ids = requests[0].prompt_token_ids
    triples = [tuple(t.id for t in result.tokens) for result in results]
    first = Counter(a for a, _, _ in triples).most_common(1)[0][0]
    guess = NgramProposer().propose(prompt_ids + [first], 1)[0]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        second = torch.softmax(model(torch.tensor([prompt_ids + [first]])).logits[0, -1] / temperature, dim=-1)
        third = torch.softmax(model(torch.tensor([prompt_ids + [first, guess]])).logits[0, -1] / temperature, dim=-1)
    accepted = [c for a, b, c in triples if a == first and b == guess]
    assert stats.num_accepted_tokens >= len(accepted) > samples / 10, "too few accepted guesses to test"
    _assert_fits(Counter(b for a, b, _ in triples if a == first), second)
    _assert_fits(Counter(accepted), third)


def _assert_fits(counts: Counter, probs: torch.Tensor, min_expected: float = 5.0) -> None:
    """Chi-square goodness of fit, tokens with few expected draws pooled into one bin."""
    total = sum(counts.values())
    expected = probs.double() * total
    big = [int(i) for i in torch.nonzero(expected >= min_expected).flatten()]
    assert len(big) >= 2, "the distribution is too peaked to test"
    observed = [counts.get(i, 0) for i in big] + [total - sum(counts.get(i, 0) for i in big)]
    wanted = [expected[i].item() for i in big] + [total - sum(expected[i].item() for i in big)]
    if wanted[-1] < min_expected:  # nothing much outside: merge the rest into the last bin
        observed[-2:], wanted[-2:] = [sum(observed[-2:])], [sum(wanted[-2:])]
    statistic = sum((o - w) ** 2 / w for o, w in zip(observed, wanted, strict=True))
    degrees = len(observed) - 1
    p_value = torch.special.gammaincc(torch.tensor(degrees / 2), torch.tensor(statistic / 2)).item()
    assert p_value > 1e-3, (p_value, observed, wanted)


def test_a_stream_carries_every_accepted_token(tiny_engine_config, start_grpc_server):
    """Over gRPC, a streamed generation with several tokens per step sends each of them, one
    message per token as TGI does, and they equal the unary call's (and plain decoding's)."""
    import dataclasses

    from textgen.v1 import generate_pb2 as pb

    request = pb.GenerateRequest(inputs=LOOP, parameters=pb.GenerateParameters(max_new_tokens=30, details=True))
    unary = {}
    for speculate in (4, 0):
        server = start_grpc_server(
            dataclasses.replace(tiny_engine_config, scheduler=SchedulerConfig(speculate=speculate))
        )
        unary[speculate] = [t.id for t in server.stub.Generate(request, timeout=60).details.tokens]
        if speculate:
            streamed = [response.token.id for response in server.stub.GenerateStream(request, timeout=60)]
            assert streamed == unary[speculate] and len(streamed) == 30
            assert server.engine.stats().num_accepted_tokens > 0
    assert unary[4] == unary[0]
