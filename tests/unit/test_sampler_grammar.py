"""The sampler with grammar rows: masks before every processor, free rows untouched, raw logprobs."""

from __future__ import annotations

import re

import torch

from inference_service.sample import Sampler, SamplingState
from inference_service.sample.grammar import GrammarSpec
from inference_service.sampling_params import SamplingParams

REGEX = "[0-9]{3}-[a-z]{2,4}"
GREEDY = SamplingParams()
SEEDED = SamplingParams(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=11)


def _logits(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Row r depends on (seed, r) only, not on the number of rows."""
    return torch.stack(
        [
            torch.randn(vocab_size, generator=torch.Generator().manual_seed(1000 * seed + row)) * 3.0
            for row in range(num_rows)
        ]
    )


def _states(params: list[SamplingParams], grammars: list, vocab_size: int) -> list[SamplingState]:
    return [
        SamplingState(p, [5, 6, 7], vocab_size, grammar=g.new_state() if g is not None else None)
        for p, g in zip(params, grammars, strict=True)
    ]


def _decode(sampler: Sampler, states: list[SamplingState], num_steps: int, seed: int):
    """Each row's tokens and logprobs over `num_steps` steps of random logits (the same per step)."""
    vocab_size = sampler.vocab_size
    tokens: list[list[int]] = [[] for _ in states]
    logprobs: list[list[float]] = [[] for _ in states]
    for step in range(num_steps):
        logits = _logits(len(states), vocab_size, seed + step)
        out = sampler(logits, states)
        for row, state in enumerate(states):
            if state.grammar is not None and state.grammar.is_complete:
                continue
            state.append(out.token_ids[row])
            tokens[row].append(out.token_ids[row])
            logprobs[row].append(out.logprobs[row])
            raw = torch.log_softmax(logits[row], dim=-1)[out.token_ids[row]].item()
            assert abs(out.logprobs[row] - raw) < 1e-5  # raw, not the masked distribution
    return tokens, logprobs


def test_mixed_batch_free_rows_are_unchanged_and_constrained_rows_match(byte_tokenizer, byte_grammar_compiler):
    vocab_size = len(byte_tokenizer)
    compiled = byte_grammar_compiler.compile(GrammarSpec("regex", REGEX))
    sampler = Sampler(vocab_size)
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    mixed, _ = _decode(sampler, _states(params, [compiled, None, None, compiled], vocab_size), 10, seed=3)
    free, _ = _decode(sampler, _states(params, [None] * 4, vocab_size), 10, seed=3)
    assert mixed[1] == free[1] and mixed[2] == free[2]  # free rows: the same tokens as without grammars
    for row in (0, 3):  # constrained rows: greedy and seeded sampling both stay in the grammar
        text = byte_tokenizer.decode(mixed[row])
        assert re.fullmatch(REGEX, text), text
        assert mixed[row] != free[row]


def test_greedy_constrained_row_takes_the_best_allowed_token(byte_tokenizer, byte_grammar_compiler):
    vocab_size = len(byte_tokenizer)
    compiled = byte_grammar_compiler.compile(GrammarSpec("regex", "[0-9]+"))
    digits = [i for i in range(vocab_size) if byte_tokenizer.decode([i]).isdigit()]
    logits = _logits(2, vocab_size, 0)
    out = Sampler(vocab_size)(logits, _states([GREEDY, GREEDY], [compiled, None], vocab_size))
    assert out.token_ids[0] == max(digits, key=lambda i: logits[0, i].item())
    assert out.token_ids[1] == logits[1].argmax().item()


def test_seeded_constrained_row_does_not_depend_on_its_batch(byte_tokenizer, byte_grammar_compiler):
    vocab_size = len(byte_tokenizer)
    compiled = byte_grammar_compiler.compile(GrammarSpec("json", '{"type": "object"}'))
    sampler = Sampler(vocab_size)
    alone, _ = _decode(sampler, _states([SEEDED], [compiled], vocab_size), 6, seed=9)
    in_batch, _ = _decode(sampler, _states([SEEDED, SEEDED, GREEDY], [compiled, None, compiled], vocab_size), 6, seed=9)
    assert alone[0] == in_batch[0]
    assert byte_tokenizer.decode(alone[0]).startswith("{")
