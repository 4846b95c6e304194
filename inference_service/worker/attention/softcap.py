"""Softcapped attention (Gemma 2's logit softcap) in torch, tile by tile: SDPA cannot apply a
softcap, and the whole score matrix of a long chunk would not fit, so the keys are taken a tile at a
time with an online softmax. The paged attention's torch path calls `attend_masked` (SDPA, or this
where a softcap is set) for prefill chunks and decode rows the native kernel does not take."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Keys per tile of the softcapped attention: its scores are [B, H, n, SOFTCAP_TILE] at a time, never
# [B, H, n, context] (a 4k-token chunk over a 16k context would be 2 GiB per layer in fp32).
SOFTCAP_TILE = 1024


def attend_masked(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float, softcap: float | None
) -> torch.Tensor:
    """Masked attention; SDPA (flash attention's tiling on CPU) unless a softcap needs the scores."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scaling, enable_gqa=keys.shape[1] != q.shape[1]
        )
    return attend_softcapped(q, keys, values, mask, scaling, softcap)


def attend_softcapped(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float,
    tile: int = SOFTCAP_TILE,
) -> torch.Tensor:
    """q [B, H, n, D], keys/values [B, KVH, L, D] (H = G * KVH), mask [n, L] or [B, 1, 1, L] →
    [B, H, n, Dv]: softmax(softcap * tanh(q·k * scaling / softcap)) · v, over tiles of `tile` keys with
    an online softmax (running max and sum in fp32), the query heads of a KV head side by side."""
    batch, heads, n, dim = q.shape
    kv_heads, length, dim_v = keys.shape[1], keys.shape[2], values.shape[3]
    groups = heads // kv_heads
    q_grouped = q.reshape(batch, kv_heads, groups * n, dim)  # head h reads KV head h // groups
    mask = mask.unsqueeze(1) if mask.dim() == 4 else mask  # → broadcast over [B, KVH, G, n, t]
    best = torch.full((batch, kv_heads, groups, n, 1), float("-inf"), device=q.device)
    total = torch.zeros(batch, kv_heads, groups, n, 1, device=q.device)
    acc = torch.zeros(batch, kv_heads, groups, n, dim_v, device=q.device)
    for start in range(0, length, tile):
        end = min(length, start + tile)
        scores = torch.matmul(q_grouped, keys[:, :, start:end].transpose(-1, -2)).float() * scaling
        scores = (torch.tanh(scores / softcap) * softcap).view(batch, kv_heads, groups, n, end - start)
        scores = scores.masked_fill(~mask[..., start:end], float("-inf"))
        new_best = torch.maximum(best, scores.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)  # rows masked so far
        weights = torch.exp(scores - shift)
        correction = torch.exp(best - shift)
        total = total * correction + weights.sum(dim=-1, keepdim=True)
        weighted = torch.matmul(
            weights.view(batch, kv_heads, groups * n, end - start).to(values.dtype), values[:, :, start:end]
        )
        acc = acc * correction + weighted.view(batch, kv_heads, groups, n, dim_v).float()
        best = new_best
    return (acc / total).view(batch, heads, n, dim_v).to(q.dtype)
