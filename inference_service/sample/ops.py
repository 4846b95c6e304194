"""Batched logits processors with per-row parameters, equal to transformers' processors row by row.

Every function takes fp32 logits `[B, V]` and per-row parameter tensors `[B]` and returns the
processed logits without modifying its input. A row whose parameter has the "off" value comes back
unchanged, so one call can serve a batch that mixes requests; the sampler still passes only the
rows that enable a feature, to save the work.

Parameter dtypes follow how transformers rounds its Python floats: `temperature`, `penalty` and
`typical_p` are fp32 tensors (a Python float meets fp32 logits as fp32); `top_p` is fp64.

Top-p uses transformers' rule (keep a token while the mass above it is < p) with fp64 sums, so
that deciding it on a few candidates gives exactly the kept set of a full sort. It can differ from
transformers' fp32 cumsum only when a token's mass is within fp32 rounding (~1e-7) of p, or when
equal logits straddle the boundary: transformers keeps an order-dependent part of them, we keep all.

Safe by construction: whatever a request's parameters, no processor returns NaN or +inf (NaN
becomes -inf, +inf the largest float; a temperature is at least `MIN_TEMPERATURE`), and
`sample_from_logits` returns an id inside the vocabulary even for a row with nothing left to
sample. A NaN in a softmax would otherwise become an out-of-range id, and an out-of-range index
fails the whole batch's gather (on a GPU, the whole device).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

NEG_INF = float("-inf")
MAX_LOGIT = torch.finfo(torch.float32).max
# Below it a temperature changes nothing a sampler can see (the top logit takes all the mass) but
# dividing by it overflows: 1e-45 turns every logit into +-inf.
MIN_TEMPERATURE = 1e-5
# Candidates per row tried in turn before a full sort. On one CPU thread with 49152 logits, topk
# costs ~0.15 ms per row at 256 and ~0.9 ms at 4096, a full sort ~4 ms.
CANDIDATE_TIERS = (256, 4096)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """-inf where the bitmask disallows: bit j of word w of a row allows token 32 * w + j.

    logits [R, V], bitmask [R, ceil(V / 32)] int32 on the logits' device.
    """
    unpack = unpack_bitmask_numpy if bitmask.device.type == "cpu" else unpack_bitmask_torch
    return torch.where(unpack(bitmask, logits.shape[-1]), logits, NEG_INF)


def unpack_bitmask_numpy(bitmask: Tensor, vocab_size: int) -> Tensor:
    """`[R, W]` int32 on CPU → allowed `[R, V]` bool, ~3x faster than torch's shifts: the words are
    little-endian, so bit k of byte b is token 8 * b + k."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]
    return torch.from_numpy(bits[:, :vocab_size]).view(torch.bool)  # [R, V]


def unpack_bitmask_torch(bitmask: Tensor, vocab_size: int) -> Tensor:
    """`[R, W]` int32 on any device → allowed `[R, V]` bool."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    return ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)[:, :vocab_size]  # [R, V]


def finite_logits(logits: Tensor) -> Tensor:
    """A copy with NaN as -inf (never chosen) and +inf as the largest float (chosen, but a softmax
    of two of them is not NaN); -inf stays -inf: it is a mask."""
    return torch.nan_to_num(logits, nan=NEG_INF, posinf=MAX_LOGIT, neginf=NEG_INF)


def apply_repetition_penalty(logits: Tensor, token_ids: Tensor, penalty: Tensor) -> Tensor:
    """Penalize each seen token once: `x * p` if x < 0 else `x / p` (p = 1: off).

    `token_ids` `[B, T]` holds each row's seen ids (prompt + output; repeats are harmless, so pad
    a row by repeating one of its ids). Only those columns are read and written, as transformers.
    """
    scores = logits.gather(1, token_ids)  # [B, T]
    p = penalty.to(logits.dtype)[:, None]  # [B, 1]
    penalized = finite_logits(torch.where(scores < 0, scores * p, scores / p))  # a tiny p overflows
    return logits.scatter(1, token_ids, penalized)  # [B, V]


def apply_frequency_penalty(
    logits: Tensor, token_ids: Tensor, token_counts: Tensor, total_lens: Tensor, penalty: Tensor
) -> Tensor:
    """TGI's frequency penalty: `x -= penalty * count / total_len` (penalty = 0: off).

    `token_ids` `[B, T]` are each row's seen ids and `token_counts` `[B, T]` their counts (a repeated
    id must repeat its count); `total_lens` counts prompt + generated tokens.
    """
    scores = logits.gather(1, token_ids)  # [B, T]
    freq = token_counts.to(logits.dtype) / total_lens.to(logits.dtype)[:, None]  # [B, T]
    return logits.scatter(1, token_ids, scores - freq * penalty.to(logits.dtype)[:, None])  # [B, V]


def apply_presence_penalty(logits: Tensor, token_ids: Tensor, penalty: Tensor) -> Tensor:
    """OpenAI's presence penalty: `x -= penalty` once for each id in `token_ids` `[B, T]`, the
    distinct ids generated so far (pad a row by repeating one of its ids)."""
    scores = logits.gather(1, token_ids)  # [B, T]
    return logits.scatter(1, token_ids, scores - penalty.to(logits.dtype)[:, None])  # [B, V]


def apply_logit_bias(logits: Tensor, token_ids: Tensor, bias: Tensor) -> Tensor:
    """OpenAI's `logit_bias`: `x[id] += bias` for each `token_ids` `[B, T]` and `bias` `[B, T]`
    (pad a row by repeating one of its pairs)."""
    scores = logits.gather(1, token_ids)  # [B, T]
    return logits.scatter(1, token_ids, scores + bias.to(logits.dtype))  # [B, V]


def apply_temperature(logits: Tensor, temperature: Tensor) -> Tensor:
    """Divide by the row's temperature, at least `MIN_TEMPERATURE` (1.0: off)."""
    return finite_logits(logits / temperature.to(logits.dtype).clamp(min=MIN_TEMPERATURE)[:, None])  # [B, V]


def apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int | None = None) -> Tensor:
    """Keep the tokens >= the k-th largest value, ties included (k = 0: off).

    `max_top_k` (the largest k, when the caller knows it) saves reading `top_k` back from the device.
    """
    num_keep = top_k.clamp(max=logits.shape[-1])  # [B]
    max_num_keep = min(int(num_keep.max()) if max_top_k is None else max_top_k, logits.shape[-1])
    if max_num_keep <= 0:
        return logits
    values = logits.topk(max_num_keep, dim=-1).values  # [B, K] descending
    return logits.masked_fill(logits < _kth_value(values, num_keep), NEG_INF)  # [B, V]


def apply_top_p(logits: Tensor, top_p: Tensor) -> Tensor:
    """Keep the smallest head whose mass reaches p, by a full sort (1.0: off)."""
    sorted_values = logits.sort(dim=-1, descending=True).values  # [B, V]
    cutoff, _ = _top_p_cutoff(logits, sorted_values, top_p)  # [B, 1]
    return logits.masked_fill(logits < cutoff, NEG_INF)  # [B, V]


def apply_top_k_top_p(
    logits: Tensor, top_k: Tensor, top_p: Tensor, candidate_tiers: tuple[int, ...] = CANDIDATE_TIERS
) -> Tensor:
    """`apply_top_p(apply_top_k(x, top_k), top_p)`, deciding top-p on the largest logits only.

    A full sort costs a third of a decode step on CPU. Each row is first decided on its
    `candidate_tiers[0]` largest logits; a row whose boundary lies past them retries with the next
    tier, and only a row left over takes the full sort. The sums over the candidates are the first
    terms of the full sort's sums, so the kept set is exactly the full sort's.
    """
    out = apply_top_k(logits, top_k)  # [B, V], may be `logits` itself
    pending = torch.nonzero(top_p < 1.0).squeeze(1)  # [P]
    for num_candidates in candidate_tiers:
        if pending.numel() == 0:
            return out
        x = out if pending.numel() == out.shape[0] else out[pending]  # [P, V]
        candidates = x.topk(min(num_candidates, x.shape[-1]), dim=-1).values  # [P, C] descending
        cutoff, covered = _top_p_cutoff(x, candidates, top_p[pending])  # [P, 1], [P]
        masked = x.masked_fill(x < cutoff, NEG_INF)  # [P, V], right for the covered rows
        if x is out and bool(covered.all()):
            return masked
        out = out.clone() if out is logits else out
        out[pending[covered]] = masked[covered]
        pending = pending[~covered]
    if pending.numel() > 0:
        out = out.clone() if out is logits else out
        out[pending] = apply_top_p(out[pending], top_p[pending])
    return out


def apply_typical_p(logits: Tensor, typical_p: Tensor) -> Tensor:
    """Typical decoding as transformers: keep tokens whose surprise is nearest the entropy (1.0: off).

    Needs a full sort of every enabled row: the slowest feature here.
    """
    normalized = torch.log_softmax(logits, dim=-1)  # [B, V]
    probs = normalized.exp()  # [B, V]
    entropy = -(normalized * probs).nansum(-1, keepdim=True)  # [B, 1]
    shifted = torch.abs(-normalized - entropy)  # [B, V]
    sorted_scores, sorted_ids = shifted.sort(dim=-1)  # [B, V] ascending
    cum_probs = logits.gather(-1, sorted_ids).softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    mass = typical_p.to(logits.dtype)[:, None]  # [B, 1]
    last_index = (cum_probs < mass).sum(dim=1).clamp_(max=logits.shape[-1] - 1)  # [B]
    remove_sorted = sorted_scores > sorted_scores.gather(1, last_index[:, None])  # [B, V]
    remove_sorted[:, 0] = False
    remove_sorted &= (typical_p < 1.0)[:, None]
    remove = remove_sorted.scatter(1, sorted_ids, remove_sorted)  # [B, V]
    return logits.masked_fill(remove, NEG_INF)


def _kth_value(values: Tensor, num_keep: Tensor) -> Tensor:
    """The k-th largest value per row from descending `values`; -inf (keep all) where k = 0."""
    kth = values.gather(1, (num_keep - 1).clamp(min=0)[:, None])  # [B, 1]
    return kth.masked_fill((num_keep <= 0)[:, None], NEG_INF)


def _top_p_cutoff(logits: Tensor, head: Tensor, top_p: Tensor) -> tuple[Tensor, Tensor]:
    """The smallest kept value per row, from the row's largest values `head` (descending).

    A token is kept while the mass strictly above it is < p, the first token always, and so is
    every token equal to a kept one. `covered` says the boundary lies within `head` (some value of
    it is dropped), so the full row would give the same cutoff. Rows with p >= 1 get -inf.
    """
    row_max = head[:, :1]  # [B, 1]
    # A cumsum runs along each row on its own, so the total is the same bits whatever the batch;
    # `sum` may split a lone row across threads and round differently.
    total = (logits - row_max).exp().cumsum(dim=-1)[:, -1:].to(torch.float64)  # [B, 1]
    probs = (head - row_max).exp().to(torch.float64) / total  # [B, C]
    mass_above = torch.nn.functional.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [B, C] monotone
    num_kept = (mass_above < top_p.to(torch.float64)[:, None]).sum(dim=-1, keepdim=True)  # [B, 1]
    num_kept = num_kept.clamp(min=1)  # a prefix, as mass_above never decreases
    cutoff = head.gather(1, num_kept - 1)  # [B, 1]
    covered = num_kept[:, 0] < head.shape[-1]  # [B]
    cutoff = cutoff.masked_fill((top_p >= 1.0)[:, None], NEG_INF)
    return cutoff, covered


def sample_from_logits(logits: Tensor, uniforms: Tensor) -> Tensor:
    """Inverse-CDF sampling: one uniform in [0, 1) per row picks the token.

    A row's token depends only on its own logits and uniform, so a request that draws its uniform
    from its own generator gets the same tokens whatever else is in the batch.
    """
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)  # [S, V] non-decreasing
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]  # [S, 1], < the total as u < 1 in fp32
    # The first token whose cdf exceeds the target: its probability is not zero. A row with no
    # token left (all -inf: its cdf is NaN) finds none; the clamp keeps its id in range, and the
    # sampler reports that row as failed.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)  # [S]
