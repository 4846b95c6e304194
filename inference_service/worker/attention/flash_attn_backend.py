"""flash-attn's kernels over our paged KV cache, on CUDA where the optional `flash-attn` extra is
installed (`pip install 'inference-service[flash-attn]'`); attention/paged.py asks `takes` first and
uses the Triton kernel (attention/triton_paged.py) where it says no.

The cache's per-layer tensors [slots, KVH, D] are, viewed as [blocks, block_size, KVH, D], the
paged layout flash-attn (>= 2.5) reads through a block table: nothing is copied. A step's prefill
chunks and decode rows go to `flash_attn_varlen_func` (cu_seqlens over the packed queries, causal
aligned to each sequence's end, the block table for its keys); decode-only steps to
`flash_attn_with_kvcache` (one query per sequence, `cache_seqlens` keys). flash-attn computes fp16
and bf16 only, with a K/V cache in the same dtype, head sizes up to 256, and pages whose size is a
multiple of 256 tokens (`--block-size 256`); anything else stays on the Triton kernel.

The arguments are built from the step's PagedLayout on the device, without reading anything back
to the host (a decode step may run inside a CUDA graph), and are tested on CPU.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import torch

from inference_service.worker.attention.triton_paged import PagedLayout

PAGE_MULTIPLE = 256  # flash-attn's paged KV: a block holds a multiple of this many tokens
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _module() -> Any:
    """flash_attn, or None where it does not import (not installed, or built for another torch)."""
    try:
        return importlib.import_module("flash_attn")
    except Exception:  # noqa: BLE001 — a broken optional build is the same as none
        return None


def available() -> bool:
    """Whether flash-attn's kernels can run here: it imports and a CUDA device is there."""
    return _module() is not None and torch.cuda.is_available()


def takes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int) -> bool:
    """Whether flash-attn computes this attention: q [..., H, D] on CUDA in fp16/bf16, the cache in
    the same dtype, head sizes flash-attn has, pages of a multiple of PAGE_MULTIPLE tokens."""
    return query.is_cuda and fits(query, key_cache, value_cache, block_size) and available()


def fits(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_size: int) -> bool:
    """The dtypes and shapes flash-attn computes, on any device (`takes` adds CUDA and the import)."""
    head_dim = query.shape[-1]
    return (
        query.dtype in DTYPES
        and key_cache.dtype == value_cache.dtype == query.dtype
        and value_cache.shape[-1] == head_dim
        and head_dim % 8 == 0
        and head_dim <= MAX_HEAD_DIM
        and block_size % PAGE_MULTIPLE == 0
        and query.shape[-2] % key_cache.shape[-2] == 0
    )


def window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's (left, right) for our window: a query at position p sees keys p - window + 1 .. p."""
    return (window - 1, 0) if window else (-1, -1)


@dataclass
class VarlenArguments:
    """A step's packed queries as flash_attn_varlen_func takes them, sequences one after another."""

    rows: torch.Tensor  # [T] the packed q row of each query, sequence by sequence
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    cu_seqlens_k: torch.Tensor  # [S + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int  # an upper bound (the block table's width): no value is read back to the host
    block_table: torch.Tensor  # [S, NB] int32


def varlen_arguments(layout: PagedLayout, num_queries: int, block_size: int) -> VarlenArguments:
    """From the step's layout (sequence i's queries are q rows [q_start_i, q_start_i + q_len_i), its
    keys the first seq_lens_i positions of its block row); `num_queries` rows in all."""
    q_len = layout.q_len.to(torch.int32)
    zero = torch.zeros(1, dtype=torch.int32, device=q_len.device)
    cu_seqlens_q = torch.cat([zero, torch.cumsum(q_len, 0, dtype=torch.int32)])
    cu_seqlens_k = torch.cat([zero, torch.cumsum(layout.seq_lens.to(torch.int32), 0, dtype=torch.int32)])
    lengths = q_len.long()
    starts = torch.repeat_interleave(layout.q_start.long(), lengths, output_size=num_queries)
    offsets = torch.arange(num_queries, device=q_len.device) - torch.repeat_interleave(
        cu_seqlens_q[:-1].long(), lengths, output_size=num_queries
    )
    return VarlenArguments(
        rows=starts + offsets,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=layout.max_q_len,
        max_seqlen_k=layout.block_table.shape[1] * block_size,
        block_table=layout.block_table.to(torch.int32).contiguous(),
    )


def paged_blocks(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """A layer's cache [slots, KVH, D] as flash-attn's pages [blocks, block_size, KVH, D] (a view)."""
    return cache.view(-1, block_size, *cache.shape[1:])


def attend_step(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: PagedLayout,
    block_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [T, H, D] (prefill chunks and decode rows, packed in any order) → [T, H, D]."""
    arguments = varlen_arguments(layout, q.shape[0], block_size)
    out = _module().flash_attn_varlen_func(
        q.index_select(0, arguments.rows),
        paged_blocks(key_cache, block_size),
        paged_blocks(value_cache, block_size),
        arguments.cu_seqlens_q,
        arguments.cu_seqlens_k,
        arguments.max_seqlen_q,
        arguments.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        window_size=window_size(window),
        softcap=softcap or 0.0,
        block_table=arguments.block_table,
    )
    return torch.empty_like(out).index_copy_(0, arguments.rows, out)


def attend_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [S, H, D], one new token per sequence, its K/V already in the cache → [S, H, D]."""
    out = _module().flash_attn_with_kvcache(
        q.unsqueeze(1),
        paged_blocks(key_cache, block_size),
        paged_blocks(value_cache, block_size),
        cache_seqlens=context_lens.to(torch.int32),
        block_table=block_table.to(torch.int32),
        softmax_scale=scale,
        causal=True,
        window_size=window_size(window),
        softcap=softcap or 0.0,
    )
    return out.squeeze(1)
