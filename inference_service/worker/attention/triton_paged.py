"""Paged attention for CUDA in Triton: prefill chunks and decode rows in one launch, over the same
block layout as the CPU path (caches [num_slots, KVH, D], slot = block * block_size + offset).

Each program takes one sequence's block of query tokens and one KV head, with all the query heads
that share it (GQA: the rows of a tile are token × head, so each K/V tile read serves every head of
its group), and walks that sequence's keys up to its last query token through the block table,
with an online softmax in fp32. Causality, a sliding window and a logit softcap are masks and one
formula here, as in attention/paged.py. The new tokens' K/V must already be in the cache (the
attention function writes them first).

Its numerics are checked on CPU under Triton's interpreter (TRITON_INTERPRET=1) against the
reference attention; on CUDA it is what `paged_attention` uses when Triton imports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # CUDA builds of torch bring Triton; a CPU build need not have it
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]
except ImportError:
    triton = None

# Rows of a tile (query tokens × heads of a group) and keys per step; tl.dot wants 16 at least.
MIN_ROWS = 16
TARGET_ROWS = 64
BLOCK_N = 32


def available() -> bool:
    """Whether Triton imports (it comes with CUDA builds of torch; a CPU build need not have it)."""
    return triton is not None


@dataclass
class PagedLayout:
    """Where each sequence's query tokens sit in the packed batch and which blocks hold its keys.

    A sequence's query tokens are rows [q_start, q_start + q_len) of q; they are its last q_len
    positions, of `seq_lens` in all (new tokens included).
    """

    q_start: torch.Tensor  # [S] int32
    q_len: torch.Tensor  # [S] int32
    seq_lens: torch.Tensor  # [S] int32
    block_table: torch.Tensor  # [S, max_blocks] int32
    max_q_len: int


if triton is not None:

    @triton.jit
    def paged_attention_kernel(
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        out_ptr,
        block_table_ptr,
        q_start_ptr,
        q_len_ptr,
        seq_lens_ptr,
        scale,
        softcap,
        window,
        group_size,
        block_size,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kh,
        stride_vs,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_bt,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        USE_WINDOW: tl.constexpr,
        USE_SOFTCAP: tl.constexpr,
    ):
        seq = tl.program_id(0)
        q_block = tl.program_id(1)
        kv_head = tl.program_id(2)
        num_q = tl.load(q_len_ptr + seq)
        if q_block * BLOCK_M < num_q:
            q_begin = tl.load(q_start_ptr + seq)
            context = tl.load(seq_lens_ptr + seq)
            first_pos = context - num_q  # position of the sequence's first query token
            rows = tl.arange(0, BLOCK_M * BLOCK_G)
            token = q_block * BLOCK_M + rows // BLOCK_G
            member = rows % BLOCK_G
            row_ok = (token < num_q) & (member < group_size)
            head = kv_head * group_size + member
            dims = tl.arange(0, BLOCK_D)
            dim_ok = dims < HEAD_DIM
            q = tl.load(
                q_ptr + (q_begin + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :],
                other=0.0,
            )
            position = first_pos + token  # [R]
            m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
            end = tl.minimum(context, first_pos + (q_block + 1) * BLOCK_M)  # keys up to the last query
            start = 0
            if USE_WINDOW:
                start = tl.maximum(0, first_pos + q_block * BLOCK_M - window + 1)
                start = start // BLOCK_N * BLOCK_N
            for key_start in range(start, end, BLOCK_N):
                key_pos = key_start + tl.arange(0, BLOCK_N)
                key_ok = key_pos < end
                block = tl.load(block_table_ptr + seq * stride_bt + key_pos // block_size, mask=key_ok, other=0)
                slot = block.to(tl.int64) * block_size + key_pos % block_size
                tile_ok = key_ok[:, None] & dim_ok[None, :]
                k = tl.load(
                    k_cache_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                    mask=tile_ok,
                    other=0.0,
                )
                scores = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # [R, N]
                if USE_SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (no libdevice needed)
                    scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
                allowed = key_ok[None, :] & (key_pos[None, :] <= position[:, None])
                if USE_WINDOW:
                    allowed = allowed & (key_pos[None, :] > position[:, None] - window)
                scores = tl.where(allowed, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
                p = tl.exp(scores - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    v_cache_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                    mask=tile_ok,
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + (q_begin + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=row_ok[:, None] & dim_ok[None, :],
            )


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    layout: PagedLayout,
    block_size: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [T, H, D] (packed query rows) → out [T, H, D]; rows no sequence claims are left unwritten."""
    if triton is None:
        raise RuntimeError("the Triton paged attention needs triton installed")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    if value_cache.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} heads of size {head_dim} over {num_kv_heads} KV heads of {value_cache.shape}")
    group = num_heads // num_kv_heads
    block_g = _pow2(group)
    block_m = 1 if layout.max_q_len == 1 else max(1, TARGET_ROWS // block_g)
    block_m = max(block_m, MIN_ROWS // block_g)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for name, tensor in (("q", q), ("key cache", key_cache), ("value cache", value_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"the {name} must be contiguous in its last dimension")
    num_seqs = layout.q_start.shape[0]
    grid = (num_seqs, -(-layout.max_q_len // block_m), num_kv_heads)
    paged_attention_kernel[grid](
        q,
        key_cache,
        value_cache,
        out,
        layout.block_table,
        layout.q_start,
        layout.q_len,
        layout.seq_lens,
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        group,
        block_size,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        out.stride(0),
        out.stride(1),
        layout.block_table.stride(0),
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, _pow2(head_dim)),
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        USE_WINDOW=window is not None and window > 0,
        USE_SOFTCAP=softcap is not None and softcap > 0,
    )
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
