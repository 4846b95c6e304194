"""The sampler end to end: processor order, greedy and seeded choice, raw logprobs, watermark."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from inference_service.sample import Sampler, SamplingState
from inference_service.sample.watermark import Watermark
from inference_service.sampling_params import SamplingParams

NEG_INF = float("-inf")
GAMMA, DELTA = 0.5, 2.0

MIXED_PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.3, top_n_tokens=3),
    SamplingParams(
        do_sample=True,
        watermark=True,
        temperature=1.4,
        top_k=20,
        top_p=0.95,
        typical_p=0.95,
        frequency_penalty=-0.4,
        seed=5,
    ),
    SamplingParams(do_sample=True, seed=1),
    SamplingParams(do_sample=True, temperature=0.7, top_k=50, seed=2, top_n_tokens=5),
    SamplingParams(do_sample=True, top_p=0.9, temperature=0.6, repetition_penalty=1.2, frequency_penalty=0.5, seed=3),
    SamplingParams(do_sample=True, typical_p=0.9, temperature=1.3, seed=4),
    SamplingParams(watermark=True, repetition_penalty=0.9, top_n_tokens=1),
    SamplingParams(do_sample=True, top_p=0.999, temperature=0.9, seed=6),
    SamplingParams(
        logit_bias=((3, 5.0), (17, -100.0)), presence_penalty=1.5, repetition_penalty=1.1, temperature=0.8, seed=7
    ),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.3, top_n_tokens=2),
]
GENERATED = [4, 9, 4, 600]  # appended to every row: the presence penalty counts these only


def _logits(num_rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale  # [B, V]


def _prompts(num_rows: int, vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (5 + 7 * i,), generator=generator).tolist() for i in range(num_rows)]


def _states(params: list[SamplingParams], prompts: list[list[int]], vocab_size: int) -> list[SamplingState]:
    return [SamplingState(p, prompt, vocab_size) for p, prompt in zip(params, prompts, strict=True)]


def _reference_row(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], generated: list[int] = ()
) -> torch.Tensor:
    """One row through our order with transformers' processors and plain loops."""
    x = logits[None, :].clone()  # [1, V]
    token_ids = [*prompt, *generated]
    ids = torch.tensor([token_ids])  # [1, T]
    if params.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias})(ids, x)
    if params.watermark:
        x = Watermark(x.shape[-1], GAMMA, DELTA).apply(x, [token_ids[-1]])
    if params.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, x)
    if params.frequency_penalty != 0.0:
        for token_id in set(token_ids):
            x[0, token_id] -= params.frequency_penalty * token_ids.count(token_id) / len(token_ids)
    for token_id in set(generated):
        x[0, token_id] -= params.presence_penalty
    warpers = [
        (params.temperature != 1.0, lambda: TemperatureLogitsWarper(params.temperature)),
        (params.top_k != 0, lambda: TopKLogitsWarper(params.top_k)),
        (params.top_p < 1.0, lambda: TopPLogitsWarper(params.top_p)),
        (params.typical_p < 1.0, lambda: TypicalLogitsWarper(params.typical_p)),
    ]
    for enabled, make in warpers:
        if enabled:
            x = make()(ids, x)
    return x[0]  # [V]


@pytest.mark.parametrize("vocab_size", [1000, 49152])
def test_process_applies_every_feature_in_order(vocab_size: int) -> None:
    logits = _logits(len(MIXED_PARAMS), vocab_size, seed=vocab_size)
    prompts = _prompts(len(MIXED_PARAMS), vocab_size, seed=1)
    sampler = Sampler(vocab_size, GAMMA, DELTA)
    states = _states(MIXED_PARAMS, prompts, vocab_size)
    for state in states:
        for token_id in GENERATED:
            state.append(token_id)
    processed = sampler.process(logits, states)
    for i, params in enumerate(MIXED_PARAMS):
        ref = _reference_row(logits[i], params, prompts[i], GENERATED)
        assert torch.equal(processed[i] == NEG_INF, ref == NEG_INF), f"row {i}: kept sets differ"
        torch.testing.assert_close(processed[i], ref, rtol=0, atol=1e-5, msg=f"row {i}")
    assert torch.equal(processed[0], logits[0])


def test_greedy_fast_path_is_argmax() -> None:
    vocab_size = 49152
    logits = _logits(16, vocab_size, seed=2)
    states = _states([SamplingParams()] * 16, _prompts(16, vocab_size, seed=3), vocab_size)
    out = Sampler(vocab_size)(logits, states)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.top_ids == [[]] * 16 and out.top_logprobs == [[]] * 16


def test_greedy_rows_take_argmax_of_processed_logits() -> None:
    vocab_size = 1000
    logits = _logits(2, vocab_size, seed=4)
    best = logits.argmax(dim=-1).tolist()
    params = [SamplingParams(repetition_penalty=50.0), SamplingParams(do_sample=True, seed=0)]
    states = _states(params, [[best[0]], [best[1]]], vocab_size)
    out = Sampler(vocab_size)(logits, states)
    penalized = RepetitionPenaltyLogitsProcessor(50.0)(torch.tensor([[best[0]]]), logits[:1].clone())
    assert out.token_ids[0] == int(penalized.argmax()) != best[0]


def test_greedy_rows_follow_logit_bias_and_presence_penalty() -> None:
    vocab_size = 1000
    logits = _logits(3, vocab_size, seed=5)
    best = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(logit_bias=((7, 100.0),)),
        SamplingParams(logit_bias=((best[1], -100.0),)),
        SamplingParams(presence_penalty=2.0),
    ]
    states = _states(params, [[1]] * 3, vocab_size)
    assert Sampler(vocab_size)(logits, states).token_ids[:2] == [7, int(logits[1].topk(2).indices[1])]
    states[2].append(best[2])  # generated once: now penalized; in the prompt only, it would not be
    expected = logits[2].clone()
    expected[best[2]] -= 2.0
    assert Sampler(vocab_size)(logits, states).token_ids[2] == int(expected.argmax())


def test_logprobs_and_top_n_are_raw_log_softmax() -> None:
    vocab_size = 49152
    logits = _logits(len(MIXED_PARAMS), vocab_size, seed=5)
    states = _states(MIXED_PARAMS, _prompts(len(MIXED_PARAMS), vocab_size, seed=6), vocab_size)
    before = logits.clone()
    out = Sampler(vocab_size, GAMMA, DELTA)(logits, states)
    assert torch.equal(logits, before), "the sampler must not write into the model's logits"
    raw = torch.log_softmax(logits, dim=-1)  # [B, V]
    chosen = raw.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)  # [B]
    torch.testing.assert_close(torch.tensor(out.logprobs), chosen, rtol=0, atol=1e-4)
    for i, params in enumerate(MIXED_PARAMS):
        ref_values, ref_ids = raw[i].topk(params.top_n_tokens)
        assert out.top_ids[i] == ref_ids.tolist()
        torch.testing.assert_close(torch.tensor(out.top_logprobs[i]), ref_values, rtol=0, atol=1e-4)
    assert [len(ids) for ids in out.top_ids] == [p.top_n_tokens for p in MIXED_PARAMS]


def _decode(
    sampler: Sampler, states: list[SamplingState], step_logits: list[torch.Tensor], tracked: SamplingState, seed: int
) -> list[int]:
    """Run steps with `tracked` at a shifting row among `states`; return its tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = []
    for row_logits in step_logits:
        position = int(torch.randint(0, len(states) + 1, (1,), generator=generator))
        batch = states[:position] + [tracked] + states[position:]
        logits = _logits(len(batch), sampler.vocab_size, seed=int(torch.randint(0, 2**31, (1,), generator=generator)))
        logits[position] = row_logits
        out = sampler(logits, batch)
        for state, token_id in zip(batch, out.token_ids, strict=True):
            state.append(token_id)
        tokens.append(out.token_ids[position])
    return tokens


@pytest.mark.parametrize("vocab_size", [1000, 49152])
def test_seeded_request_ignores_its_batch(vocab_size: int) -> None:
    num_steps = 8
    sampler = Sampler(vocab_size, GAMMA, DELTA)
    params = SamplingParams(
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        watermark=True,
        seed=42,
    )
    step_logits = list(_logits(num_steps, vocab_size, seed=7, scale=1.0))
    prompt = [3, 1, 4, 1, 5]
    alone = _decode(sampler, [], step_logits, SamplingState(params, prompt, vocab_size), seed=0)
    random_seeds = torch.randint(0, 2**62, (2,), generator=torch.Generator().manual_seed(8)).tolist()
    neighbours = [
        SamplingParams(do_sample=True, seed=42),
        SamplingParams(),
        SamplingParams(do_sample=True, top_k=5, seed=random_seeds[0]),
        SamplingParams(do_sample=True, typical_p=0.5, seed=random_seeds[1], top_n_tokens=2),
        SamplingParams(do_sample=True, top_p=0.95, temperature=0.8, seed=43),
    ]
    others = _states(neighbours, _prompts(len(neighbours), vocab_size, seed=8), vocab_size)
    batched = _decode(sampler, others, step_logits, SamplingState(params, prompt, vocab_size), seed=1)
    assert batched == alone
    assert len(set(alone)) > 1
    other_seed = SamplingState(dataclasses.replace(params, seed=7), prompt, vocab_size)
    assert _decode(sampler, [], step_logits, other_seed, seed=0) != alone


def _green_fraction(watermark: bool, vocab_size: int = 1000, num_rows: int = 32, num_steps: int = 8) -> float:
    sampler = Sampler(vocab_size, GAMMA, DELTA)
    greenlists = Watermark(vocab_size, GAMMA, DELTA)
    params = [SamplingParams(do_sample=True, watermark=watermark, seed=i) for i in range(num_rows)]
    states = _states(params, _prompts(num_rows, vocab_size, seed=9), vocab_size)
    num_green = 0
    for step in range(num_steps):
        previous = [s.last_token_id for s in states]
        out = sampler(_logits(num_rows, vocab_size, seed=100 + step, scale=1.0), states)
        for state, prev, token_id in zip(states, previous, out.token_ids, strict=True):
            num_green += token_id in set(greenlists.greenlist(prev).tolist())
            state.append(token_id)
    return num_green / (num_rows * num_steps)


def test_watermark_raises_green_fraction() -> None:
    assert 0.35 < _green_fraction(watermark=False) < 0.65
    assert _green_fraction(watermark=True) > 0.75


def test_sampling_state_tracks_tokens() -> None:
    vocab_size = 10
    state = SamplingState(SamplingParams(frequency_penalty=0.5, seed=3), [1, 1, 4, 12], vocab_size)
    assert state.generator is None and state.token_counts is not None
    assert state.seen_token_ids().tolist() == [1, 4]
    state.append(4)
    state.append(7)
    assert state.token_counts.tolist() == [0, 2, 0, 0, 2, 0, 0, 1, 0, 0]
    assert state.seen_token_ids().tolist() == [1, 4, 7]
    assert (state.last_token_id, state.num_tokens) == (7, 6)
    plain = SamplingState(SamplingParams(do_sample=True, top_k=3), [2], vocab_size)
    assert plain.generator is not None and plain.token_counts is None
    empty = SamplingState(SamplingParams(repetition_penalty=2.0), [], vocab_size)  # nothing seen yet
    logits = torch.arange(20.0).reshape(2, vocab_size)  # [2, V]
    assert Sampler(vocab_size)(logits, [empty, state]).token_ids == [9, 9]
    empty.append(9)
    assert Sampler(vocab_size)(logits, [empty, state]).token_ids == [8, 9]
    with pytest.raises(ValueError):
        SamplingState(SamplingParams(watermark=True), [], vocab_size)


def test_sampler_rejects_mismatched_logits() -> None:
    states = _states([SamplingParams()] * 2, [[1], [2]], 100)
    with pytest.raises(ValueError):
        Sampler(100)(torch.zeros(3, 100), states)
    with pytest.raises(ValueError):
        Sampler(100)(torch.zeros(2, 99), states)
