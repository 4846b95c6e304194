"""The sampler is safe by construction: no parameter value turns logits into NaN, +inf or an id
outside the vocabulary; a row with nothing to choose raises a typed error instead of a token; and
a position sampled again (the engine's row-by-row retry) draws the same uniform."""

from __future__ import annotations

import pytest
import torch

from inference_service.errors import GenerationError
from inference_service.sample import Sampler, SamplingState, ops
from inference_service.sampling_params import SamplingParams

V = 64


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 5


def state(params: SamplingParams, prompt=(1, 2, 3, 5, 8)) -> SamplingState:
    return SamplingState(params, list(prompt), V)


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-20])
def test_a_tiny_temperature_gives_finite_logits(temperature):
    out = ops.apply_temperature(logits(2), torch.tensor([temperature, 1.0]))
    assert not out.isnan().any() and not out.isposinf().any()
    assert torch.equal(out.argmax(-1), logits(2).argmax(-1))


@pytest.mark.parametrize("penalty", [1e-45, 1e-38, 3e38])
def test_an_extreme_repetition_penalty_gives_no_nan_or_positive_infinity(penalty):
    x = logits()
    x[0, :4] = torch.tensor([0.0, 30.0, -30.0, float("-inf")])  # a masked id stays masked
    out = ops.apply_repetition_penalty(x, torch.tensor([[0, 1, 2, 3]]), torch.tensor([penalty]))
    assert not out.isnan().any() and not out.isposinf().any()
    assert out[0, 3] == float("-inf") and torch.equal(out[0, 4:], x[0, 4:])


def test_finite_logits_keeps_masks_and_finite_values():
    x = torch.tensor([[1.0, float("nan"), float("inf"), float("-inf"), -2.0]])
    out = ops.finite_logits(x)
    assert out.tolist() == [[1.0, float("-inf"), ops.MAX_LOGIT, float("-inf"), -2.0]]


def test_sampling_a_row_with_nothing_left_stays_in_the_vocabulary():
    rows = torch.full((2, V), float("-inf"))
    rows[1, 7] = 0.0
    ids = ops.sample_from_logits(rows, torch.tensor([0.5, 0.5]))
    assert 0 <= int(ids[0]) < V and int(ids[1]) == 7


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(do_sample=True, seed=1), SamplingParams(repetition_penalty=1.2)],
    ids=["greedy", "sampling", "processed-greedy"],
)
@pytest.mark.parametrize("bad", ["nan", "-inf"])
def test_a_row_with_nothing_to_choose_raises_a_typed_error(params, bad):
    """NaN logits (a broken model) or every token excluded: no arbitrary token is made up."""
    x = logits(2)
    x[1] = float(bad)
    sampler = Sampler(V)
    with pytest.raises(GenerationError, match="no token could be sampled"):
        sampler(x, [state(params), state(params)])
    assert len(sampler(x[:1], [state(params)]).token_ids) == 1  # the good row alone is fine


def test_a_forced_token_needs_no_choice():
    x = logits()
    x[0] = float("nan")
    out = Sampler(V)(x, [state(SamplingParams(forced_token_ids=((0, 9),)))])
    assert out.token_ids == [9]


def test_a_forced_row_does_not_excuse_another_row_with_nothing_to_choose():
    """The check reads every row's chosen logit at once: a forced row passes, its neighbour does not."""
    x = logits(2)
    x[:] = float("nan")
    states = [state(SamplingParams(forced_token_ids=((0, 9),))), state(SamplingParams())]
    with pytest.raises(GenerationError, match="no token could be sampled"):
        Sampler(V)(x, states)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(top_n_tokens=3)], ids=["plain", "top-n"])
def test_greedy_rows_take_argmax_first_of_tied_maxima(params):
    """Greedy rows take the maximum and its logit in one op: the same id as argmax, ties included."""
    x = logits(4, seed=3)
    x[1, [5, 40]] = x[1].max() + 1  # a tie: the first one wins, as with argmax
    x[2, :] = -3.0  # every logit tied
    x[3, 7] = float("inf")  # +inf is a choice, not a failure
    out = Sampler(V)(x, [state(params) for _ in range(4)])
    assert out.token_ids == x.argmax(-1).tolist() == [out.token_ids[0], 5, 0, 7]
    expected = torch.log_softmax(x, -1).gather(1, x.argmax(-1)[:, None]).squeeze(1)
    assert out.logprobs[:3] == pytest.approx(expected[:3].tolist())


def test_a_position_sampled_again_draws_the_same_uniform():
    """The engine retries a failed batch row by row: the retry must give the same token."""
    params = SamplingParams(do_sample=True, seed=11, temperature=1.5)
    sampler, x = Sampler(V), logits(3, seed=4)
    fresh = state(params)
    batched = [state(SamplingParams(do_sample=True, seed=2)), fresh, state(SamplingParams())]
    first = sampler(x, batched).token_ids[1]
    assert sampler(x[1:2], [fresh]).token_ids == [first]  # the same position: the same draw
    assert torch.equal(fresh.uniform(), torch.rand(1, generator=torch.Generator().manual_seed(11)))  # the first
    reference = state(params)  # the same request, never retried
    assert sampler(x[1:2], [reference]).token_ids == [first]
    fresh.append(first)
    reference.append(first)
    assert torch.equal(fresh.uniform(), fresh.uniform())  # the next position's draw, kept
    assert sampler(x[1:2], [fresh]).token_ids == sampler(x[1:2], [reference]).token_ids
