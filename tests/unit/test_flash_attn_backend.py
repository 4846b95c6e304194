"""flash-attn's kernels over the paged cache (attention/flash_attn_backend.py): when they are chosen,
and the arguments they get. On CPU the arguments are read back the way flash-attn's documentation
says its varlen kernel reads them (sequences packed by cu_seqlens, causal aligned to each
sequence's end, keys through the block table, window (left, right)), in float64, and must give the
reference attention on ragged, shuffled paged layouts with GQA and windows. The kernels themselves
run only where CUDA and flash_attn are there (skipped otherwise)."""

from __future__ import annotations

import pytest
import torch

from inference_service.worker.attention import flash_attn_backend as backend
from inference_service.worker.attention.triton_paged import PagedLayout

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
# (queries, context) per sequence: decode rows, a first chunk, a chunk over a cached prefix.
SEQUENCES = [(1, 37), (5, 5), (1, 3), (6, 30), (1, 64), (3, 12)]


def _layout(block_size: int, device: str = "cpu", seed: int = 0) -> tuple[PagedLayout, int]:
    """Sequences' queries packed in a shuffled order, their blocks drawn shuffled from the pool."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(SEQUENCES), generator=generator).tolist()
    starts = [0] * len(SEQUENCES)
    row = 0
    for index in order:
        starts[index] = row
        row += SEQUENCES[index][0]
    widths = [-(-context // block_size) for _, context in SEQUENCES]
    pool = torch.randperm(sum(widths) + 3, generator=generator)
    table = torch.zeros(len(SEQUENCES), max(widths), dtype=torch.int32)
    taken = 0
    for index, width in enumerate(widths):
        table[index, :width] = pool[taken : taken + width]
        taken += width
    layout = PagedLayout(
        q_start=torch.tensor(starts, dtype=torch.int32, device=device),
        q_len=torch.tensor([q for q, _ in SEQUENCES], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c for _, c in SEQUENCES], dtype=torch.int32, device=device),
        block_table=table.to(device),
        max_q_len=max(q for q, _ in SEQUENCES),
    )
    return layout, sum(widths) + 3


def _tensors(layout: PagedLayout, num_blocks: int, block_size: int, dtype=torch.float64, device="cpu"):
    generator = torch.Generator().manual_seed(1)
    total = int(layout.q_len.sum())
    q = torch.randn(total, HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    keys = torch.randn(num_blocks * block_size, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    values = torch.randn(num_blocks * block_size, KV_HEADS, HEAD_DIM, generator=generator, dtype=torch.float64)
    return q.to(device, dtype), keys.to(device, dtype), values.to(device, dtype)


def _reference(q, keys, values, layout, block_size, scale, window):
    """Each sequence's queries (its last q_len positions) over its keys, our window: p - window < k <= p."""
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(len(SEQUENCES)):
        start, q_len, context = int(layout.q_start[i]), int(layout.q_len[i]), int(layout.seq_lens[i])
        slots = (layout.block_table[i].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:context]
        k, v = keys[slots].double(), values[slots].double()  # [L, KVH, D]
        for j in range(q_len):
            position = context - q_len + j
            allowed = torch.arange(context) <= position
            if window:
                allowed &= torch.arange(context) > position - window
            for h in range(HEADS):
                scores = (k[:, h // (HEADS // KV_HEADS)] @ q[start + j, h].double()) * scale
                weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), 0)
                out[start + j, h] = weights @ v[:, h // (HEADS // KV_HEADS)]
    return out


def _as_flash_attn_reads_them(q, keys, values, arguments: backend.VarlenArguments, block_size, scale, window_size):
    """flash_attn_varlen_func's documented semantics over paged K/V, in float64, then scattered back."""
    packed = q.index_select(0, arguments.rows).double()
    pages_k, pages_v = backend.paged_blocks(keys, block_size), backend.paged_blocks(values, block_size)
    out = torch.zeros_like(packed)
    left, right = window_size
    cu_q, cu_k = arguments.cu_seqlens_q.tolist(), arguments.cu_seqlens_k.tolist()
    for i in range(len(cu_q) - 1):
        q_len, k_len = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        assert q_len <= arguments.max_seqlen_q and k_len <= arguments.max_seqlen_k
        k = pages_k[arguments.block_table[i].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:k_len].double()
        v = pages_v[arguments.block_table[i].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:k_len].double()
        for j in range(q_len):
            row = j + k_len - q_len  # causal, aligned to the bottom right
            key = torch.arange(k_len)
            allowed = key <= row + (right if right >= 0 else 0)
            if left >= 0:
                allowed &= key >= row - left
            for h in range(HEADS):
                scores = (k[:, h // (HEADS // KV_HEADS)] @ packed[cu_q[i] + j, h]) * scale
                weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), 0)
                out[cu_q[i] + j, h] = weights @ v[:, h // (HEADS // KV_HEADS)]
    return torch.empty_like(out).index_copy_(0, arguments.rows, out)


def test_window_sizes_are_flash_attns_left_and_right():
    assert backend.window_size(None) == backend.window_size(0) == (-1, -1)
    assert backend.window_size(5) == (4, 0)  # keys p-4 .. p: five positions


def test_varlen_arguments_pack_each_sequences_queries_in_order():
    layout, _ = _layout(block_size=4)
    arguments = backend.varlen_arguments(layout, int(layout.q_len.sum()), block_size=4)
    assert arguments.cu_seqlens_q.tolist() == [0, 1, 6, 7, 13, 14, 17]
    assert arguments.cu_seqlens_k.tolist() == [0, 37, 42, 45, 75, 139, 151]
    assert arguments.cu_seqlens_q.dtype == arguments.cu_seqlens_k.dtype == arguments.block_table.dtype == torch.int32
    expected = [int(layout.q_start[i]) + j for i, (q_len, _) in enumerate(SEQUENCES) for j in range(q_len)]
    assert arguments.rows.tolist() == expected
    assert arguments.max_seqlen_q == 6 and arguments.max_seqlen_k == layout.block_table.shape[1] * 4 >= 64


@pytest.mark.parametrize("window", [None, 5, 16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_the_arguments_as_flash_attn_reads_them_give_the_reference_attention(window, block_size):
    layout, num_blocks = _layout(block_size)
    q, keys, values = _tensors(layout, num_blocks, block_size)
    arguments = backend.varlen_arguments(layout, q.shape[0], block_size)
    scale = HEAD_DIM**-0.5
    ours = _as_flash_attn_reads_them(q, keys, values, arguments, block_size, scale, backend.window_size(window))
    expected = _reference(q, keys, values, layout, block_size, scale, window)
    assert torch.allclose(ours, expected, atol=1e-12), f"max |diff| {(ours - expected).abs().max():.3g}"


def test_what_flash_attn_computes_and_what_it_leaves_to_triton():
    q = torch.zeros(3, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cache = torch.zeros(512, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    assert backend.fits(q, cache, cache, 256)
    assert not backend.fits(q, cache, cache, 16)  # flash-attn's pages hold a multiple of 256 tokens
    assert not backend.fits(q.float(), cache.float(), cache.float(), 256)  # fp32: Triton
    assert not backend.fits(q, cache.to(torch.int8), cache.to(torch.int8), 256)  # int8 cache
    wide = torch.zeros(3, HEADS, 512, dtype=torch.bfloat16)
    assert not backend.fits(wide, cache.new_zeros(512, KV_HEADS, 512), cache.new_zeros(512, KV_HEADS, 512), 256)
    assert not backend.takes(q, cache, cache, 256), "CPU tensors are never flash-attn's"


def test_without_flash_attn_the_cuda_path_stays_on_triton(monkeypatch):
    monkeypatch.setattr(backend, "_module", lambda: None)
    assert not backend.available()


CUDA_FLASH = torch.cuda.is_available() and backend._module() is not None


@pytest.mark.skipif(not CUDA_FLASH, reason="needs CUDA and the flash-attn extra")
@pytest.mark.parametrize("window", [None, 40])
def test_flash_attn_kernels_match_the_reference_on_paged_layouts(window):
    block_size = 256
    layout, num_blocks = _layout(block_size, device="cuda")
    q, keys, values = _tensors(layout, num_blocks, block_size, torch.bfloat16, "cuda")
    scale = HEAD_DIM**-0.5
    expected = _reference(q.cpu(), keys.cpu(), values.cpu(), _layout(block_size)[0], block_size, scale, window)
    step = backend.attend_step(q, keys, values, layout, block_size, scale, window, None)
    assert torch.allclose(step.cpu().double(), expected, atol=2e-2)
    decode = [i for i, (q_len, _) in enumerate(SEQUENCES) if q_len == 1]
    rows = layout.q_start[decode].long()
    out = backend.attend_decode(
        q[rows], keys, values, layout.block_table[decode], layout.seq_lens[decode], block_size, scale, window, None
    )
    assert torch.allclose(out.cpu().double(), expected[rows.cpu()], atol=2e-2)
