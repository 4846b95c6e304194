"""The batched ops against transformers' processors (one row at a time) and plain reference loops."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from inference_service.sample import ops
from inference_service.sample.watermark import HASH_KEY, Watermark

NEG_INF = float("-inf")
# Per row: (repetition_penalty, temperature, top_k, top_p, typical_p); 1.0 / 0 mean "off".
MIXED_ROWS = [
    (1.0, 1.0, 0, 1.0, 1.0),
    (1.3, 0.7, 0, 1.0, 1.0),
    (0.8, 1.0, 50, 1.0, 1.0),
    (1.0, 1.5, 0, 0.9, 1.0),
    (1.2, 1.0, 40, 0.95, 1.0),
    (1.0, 1.0, 0, 1.0, 0.9),
    (1.1, 0.5, 5, 0.8, 0.95),
    (1.0, 2.0, 2000, 0.5, 1.0),
    (1.0, 1.0, 1, 1.0, 1.0),
    (1.0, 0.9, 0, 0.999, 0.5),
]


def _logits(num_rows: int, vocab_size: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, vocab_size, generator=generator) * scale  # [B, V]


def _history(num_rows: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab_size, (int(n),), generator=generator)
        for n in torch.randint(1, 60, (num_rows,), generator=generator)
    ]


def _padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Rows of ids of different lengths as `[B, T]`, each padded by repeating its first id."""
    width = max(len(r) for r in rows)
    return torch.stack([torch.cat([r, r[:1].expand(width - len(r))]) for r in rows])  # [B, T]


def _column(index: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([row[index] for row in MIXED_ROWS], dtype=dtype)  # [B]


def _per_row(logits: torch.Tensor, make, values, history=None) -> torch.Tensor:
    """transformers' processor applied one row at a time with that row's scalar parameter."""
    rows = []
    for i, value in enumerate(values):
        row = logits[i : i + 1]
        ids = history[i][None, :] if history is not None else torch.zeros(1, 1, dtype=torch.long)
        rows.append(row if make(value) is None else make(value)(ids, row.clone()))
    return torch.cat(rows)  # [B, V]


def _assert_same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.equal(ours == NEG_INF, ref == NEG_INF), "kept sets differ"
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("vocab_size", [1000, 49152])
def test_each_op_matches_transformers_row_by_row(vocab_size: int) -> None:
    logits = _logits(len(MIXED_ROWS), vocab_size, seed=vocab_size)
    history = _history(len(MIXED_ROWS), vocab_size, seed=1)
    rep = _column(0, torch.float32)
    _assert_same(
        ops.apply_repetition_penalty(logits, _padded(history), rep),
        _per_row(
            logits,
            lambda v: RepetitionPenaltyLogitsProcessor(v) if v != 1.0 else None,
            [row[0] for row in MIXED_ROWS],
            history,
        ),
    )
    temperature = _column(1, torch.float32)
    _assert_same(
        ops.apply_temperature(logits, temperature),
        _per_row(logits, lambda v: TemperatureLogitsWarper(v) if v != 1.0 else None, [row[1] for row in MIXED_ROWS]),
    )
    top_k = _column(2, torch.int64)
    ref_top_k = _per_row(logits, lambda v: TopKLogitsWarper(v) if v else None, top_k.tolist())
    _assert_same(ops.apply_top_k(logits, top_k), ref_top_k)
    _assert_same(ops.apply_top_k(logits, top_k, max_top_k=int(top_k.max())), ref_top_k)
    top_p = _column(3, torch.float64)
    ref_top_p = _per_row(logits, lambda v: TopPLogitsWarper(v) if v < 1.0 else None, top_p.tolist())
    _assert_same(ops.apply_top_p(logits, top_p), ref_top_p)
    _assert_same(ops.apply_top_k_top_p(logits, torch.zeros_like(top_k), top_p), ref_top_p)
    typical_p = _column(4, torch.float32)
    _assert_same(
        ops.apply_typical_p(logits, typical_p),
        _per_row(logits, lambda v: TypicalLogitsWarper(v) if v < 1.0 else None, [row[4] for row in MIXED_ROWS]),
    )


def test_thresholds_hit_exactly_match_transformers() -> None:
    """Probabilities 1/16, 2/16, 5/16, 8/16 are exact in fp32, so cumulative sums equal p exactly."""
    masses = [0.3125, 0.5, 0.8125, 0.9375]
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0, 8.0]])).expand(len(masses), -1)  # [4, 4]
    top_p = torch.tensor(masses, dtype=torch.float64)
    ref_top_p = _per_row(logits, TopPLogitsWarper, masses)
    _assert_same(ops.apply_top_p(logits, top_p), ref_top_p)
    _assert_same(ops.apply_top_k_top_p(logits, torch.zeros(4, dtype=torch.int64), top_p), ref_top_p)
    _assert_same(ops.apply_typical_p(logits, torch.tensor(masses)), _per_row(logits, TypicalLogitsWarper, masses))
    assert (ref_top_p == NEG_INF).sum(dim=-1).tolist() == [3, 3, 2, 1]


def test_ops_filter_something() -> None:
    """Guards the comparisons above against a batch where every op happens to be a no-op."""
    logits = _logits(len(MIXED_ROWS), 1000, seed=3)
    for out in (
        ops.apply_top_k(logits, _column(2, torch.int64)),
        ops.apply_top_p(logits, _column(3, torch.float64)),
        ops.apply_typical_p(logits, _column(4, torch.float32)),
    ):
        num_removed = (out == NEG_INF).sum(dim=-1)  # [B]
        assert (num_removed > 0).sum() >= 3
        assert (num_removed < 1000).all()


@pytest.mark.parametrize("vocab_size,scale", [(1000, 3.0), (49152, 2.0), (49152, 8.0)])
def test_candidate_path_equals_exact_path(vocab_size: int, scale: float) -> None:
    logits = _logits(len(MIXED_ROWS), vocab_size, seed=7, scale=scale)
    top_k = _column(2, torch.int64)
    top_p = _column(3, torch.float64)
    exact = ops.apply_top_p(ops.apply_top_k(logits, top_k), top_p)
    for tiers in ((16,), (16, 64), ops.CANDIDATE_TIERS):
        _assert_same(ops.apply_top_k_top_p(logits, top_k, top_p, tiers), exact)


def test_candidate_tiers_and_exact_fallback() -> None:
    """Rows the first tier decides, rows the second tier decides, and rows only a full sort decides."""
    vocab_size = 49152
    logits = torch.cat(
        [
            _logits(1, vocab_size, seed=12, scale=6.0),  # peaked: a few hundred tokens
            _logits(1, vocab_size, seed=13, scale=3.0),  # ~2500 tokens in the nucleus
            _logits(2, vocab_size, seed=11, scale=0.05),  # near flat: most of the vocabulary
            torch.zeros(1, vocab_size),
        ]
    )  # flat: every value ties
    top_p = torch.tensor([0.9, 0.9, 0.999, 0.9, 0.5], dtype=torch.float64)
    covered_by_tier = []
    for num_candidates in ops.CANDIDATE_TIERS:
        candidates = logits.topk(num_candidates, dim=-1).values  # [B, C]
        covered_by_tier.append(ops._top_p_cutoff(logits, candidates, top_p)[1].tolist())
    assert covered_by_tier == [[True, False, False, False, False], [True, True, False, False, False]]
    out = ops.apply_top_k_top_p(logits, torch.zeros(5, dtype=torch.int64), top_p)
    _assert_same(out, ops.apply_top_p(logits, top_p))
    _assert_same(out[:4], _per_row(logits[:4], TopPLogitsWarper, top_p[:4].tolist()))
    assert (out[4] == 0.0).all()  # equal logits are kept together


def test_frequency_penalty_matches_reference_loop() -> None:
    vocab_size = 1000
    logits = _logits(4, vocab_size, seed=5)
    history = _history(4, vocab_size, seed=6)
    penalty = torch.tensor([0.0, 0.5, 1.5, -0.7])
    total_lens = torch.tensor([len(h) for h in history])
    distinct = [h.unique() for h in history]
    counts = [torch.bincount(h, minlength=vocab_size)[d] for h, d in zip(history, distinct, strict=True)]
    out = ops.apply_frequency_penalty(logits, _padded(distinct), _padded(counts), total_lens, penalty)
    ref = logits.clone()
    for i, ids in enumerate(history):
        for token_id in set(ids.tolist()):
            count = ids.tolist().count(token_id)
            ref[i, token_id] -= penalty[i].item() * count / len(ids)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert torch.equal(out[0], logits[0])
    assert not torch.equal(out[1], logits[1])


def test_watermark_matches_reference_loop() -> None:
    vocab_size, gamma, delta = 1000, 0.25, 2.0
    logits = _logits(3, vocab_size, seed=8)
    previous = [0, 17, 999]
    out = Watermark(vocab_size, gamma, delta).apply(logits, previous)
    ref = logits.clone()
    for i, token_id in enumerate(previous):
        generator = torch.Generator().manual_seed(HASH_KEY * token_id)
        green = torch.randperm(vocab_size, generator=generator)[: int(vocab_size * gamma)]
        for j in green.tolist():
            ref[i, j] = ref[i, j] + delta
    assert torch.equal(out, ref)
    assert ((out - logits) != 0).sum(dim=-1).tolist() == [250, 250, 250]


def test_sample_from_logits_inverse_cdf() -> None:
    probs = torch.tensor([[0.0, 0.1, 0.2, 0.3, 0.4, 0.0]])  # [1, 6]
    logits = probs.log().expand(6, -1)  # [6, 6], zero probability is -inf
    uniforms = torch.tensor([0.0, 0.05, 0.15, 0.35, 0.99, 1.0 - 2.0**-24])
    assert ops.sample_from_logits(logits, uniforms).tolist() == [1, 1, 2, 3, 4, 4]


def test_sample_from_logits_follows_the_distribution() -> None:
    logits = _logits(1, 8, seed=9, scale=1.0)  # [1, 8]
    num_draws = 4000
    uniforms = (torch.arange(num_draws) + 0.5) / num_draws  # an even grid over [0, 1)
    tokens = ops.sample_from_logits(logits.expand(num_draws, -1), uniforms)
    counts = torch.bincount(tokens, minlength=8).float()
    torch.testing.assert_close(counts, logits.softmax(-1)[0] * num_draws, rtol=0, atol=1.01)
