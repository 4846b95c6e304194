"""The native per-row logits statistics (argmax, max, log-sum-exp) against torch, and the sampler with
them against the sampler without: the same tokens, the same raw logprobs within float rounding."""

from __future__ import annotations

import pytest
import torch

from inference_service.errors import GenerationError
from inference_service.sample import Sampler, SamplingState
from inference_service.sampling_params import SamplingParams
from inference_service.worker.kernels.logits_bindings import LogitsRowStats, logits_row_stats_for

LOGPROB_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def stats() -> LogitsRowStats:
    built = logits_row_stats_for(torch.device("cpu"))
    assert built is not None, "the native kernels did not build (is a C++ compiler installed?)"
    return built


def _expected(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's answers: first argmax and max (torch.max), and the argmax's raw logprob (log_softmax)."""
    maxes, index = logits.max(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, index[:, None]).squeeze(1)
    return index, maxes, logprobs


@pytest.mark.parametrize("rows", [0, 1, 3, 16])
@pytest.mark.parametrize("vocab", [1, 7, 33, 1000, 49152])
def test_argmax_max_and_logprob_match_torch(stats, rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab)) * 4
    index, maxes, log_sums = stats(logits)
    expected_index, expected_max, expected_logprob = _expected(logits)
    assert torch.equal(index, expected_index) and torch.equal(maxes, expected_max)
    torch.testing.assert_close(-log_sums, expected_logprob, rtol=0, atol=LOGPROB_TOLERANCE)


def test_ties_take_the_first_and_odd_values_follow_torch(stats):
    """Ties: the first index. A NaN is the maximum (the first one); a row of -inf has its maximum at 0;
    NaN or +inf in a row make its logprobs NaN, as log_softmax's are."""
    logits = torch.randn(6, 1003)
    logits[0, [17, 900]] = 50.0
    logits[1, [5, 600]] = float("nan")
    logits[2] = float("-inf")
    logits[3, [8, 1002]] = float("inf")
    logits[4, 1002] = 60.0  # in the tail the vector loops leave
    logits[5, :500] = float("-inf")
    index, maxes, log_sums = stats(logits)
    expected_index, expected_max, expected_logprob = _expected(logits)
    assert index.tolist() == expected_index.tolist() == [17, 5, 0, 8, 1002, int(expected_index[5])]
    assert torch.equal(maxes.isnan(), expected_max.isnan())
    assert torch.equal(maxes.nan_to_num(), expected_max.nan_to_num())
    assert (-log_sums)[1:4].isnan().all() and expected_logprob[1:4].isnan().all()
    finite = [0, 4, 5]
    torch.testing.assert_close(-log_sums[finite], expected_logprob[finite], rtol=0, atol=LOGPROB_TOLERANCE)


def test_far_below_the_maximum_counts_as_nothing(stats):
    """Values more than 87 below the maximum (past fp32's exp range) add nothing, as in log_softmax."""
    logits = torch.full((1, 64), -1e30)
    logits[0, 3] = 0.0
    logits[0, 40] = -200.0
    index, maxes, log_sums = stats(logits)
    assert index.item() == 3 and maxes.item() == 0.0 and log_sums.item() == 0.0


GREEDY_AND_SAMPLING = [
    SamplingParams(),
    SamplingParams(do_sample=True, seed=1),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(do_sample=True, temperature=0.7, top_k=50, seed=2),
    SamplingParams(),
    SamplingParams(forced_token_ids=((0, 9),)),
    SamplingParams(do_sample=True, top_p=0.9, temperature=0.6, seed=3),
    SamplingParams(logit_bias=((3, 5.0),), presence_penalty=1.5, temperature=0.8, seed=7),
]


def _states(params: list[SamplingParams], vocab: int) -> list[SamplingState]:
    return [SamplingState(p, [1, 2, 3 + i], vocab) for i, p in enumerate(params)]


@pytest.mark.parametrize(
    "params",
    [[SamplingParams()] * 16, GREEDY_AND_SAMPLING, [*GREEDY_AND_SAMPLING, SamplingParams(top_n_tokens=3)]],
    ids=["greedy", "mixed", "mixed-with-top-n"],
)
def test_the_sampler_chooses_the_same_with_and_without_native_stats(stats, params):
    vocab = 49152
    logits = torch.randn(len(params), vocab, generator=torch.Generator().manual_seed(len(params))) * 3
    before = logits.clone()
    plain = Sampler(vocab)(logits, _states(params, vocab))
    native = Sampler(vocab, row_stats=stats)(logits, _states(params, vocab))
    assert torch.equal(logits, before), "the sampler must not write into the model's logits"
    assert native.token_ids == plain.token_ids
    torch.testing.assert_close(
        torch.tensor(native.logprobs), torch.tensor(plain.logprobs), rtol=0, atol=LOGPROB_TOLERANCE
    )
    assert native.top_ids == plain.top_ids and native.top_logprobs == plain.top_logprobs


@pytest.mark.parametrize("bad", ["nan", "-inf"])
def test_a_row_with_nothing_to_choose_still_raises(stats, bad):
    logits = torch.randn(2, 100)
    logits[1] = float(bad)
    with pytest.raises(GenerationError, match="no token could be sampled"):
        Sampler(100, row_stats=stats)(logits, _states([SamplingParams()] * 2, 100))
