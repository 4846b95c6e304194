"""A prefill chunk's attention over its cached prefix (attention/prefill.py), against float64 math.

The prefix is written through the cache's own conversion into shuffled blocks; the chunk's new rows
are attended as computed (as the step hands them over). The reference is float64 softmax attention
over the values the cache holds for the prefix and the fresh rows for the chunk, so only the
kernels' fp32 arithmetic differs. The split path (prefix and self apart, merged by log-sum-exp) and
the masked path (a window, a softcap) are both checked, and the split path is checked to allocate
nothing as large as a chunk-by-context matrix.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
from inference_service.worker.attention.prefill import attend_chunk, prefill_mask

# fp32 kernels against float64 math over the same inputs (largest seen: ~1e-6).
TOLERANCE = 1e-5
BF16_TOLERANCE = 3e-2  # a bf16 model: q, k, v and the output rounded to 8 significant bits


class Chunk:
    """`num_new` new rows at positions num_computed.. of a sequence whose prefix sits in the cache."""

    def __init__(self, heads, kv_heads, dim, num_computed, num_new, kv_dtype, dtype=torch.float32, seed=0):
        generator = torch.Generator().manual_seed(seed)
        block_size = 16
        length = num_computed + num_new
        num_blocks = -(-length // block_size) + 2
        self.cache = PagedKVCache(
            [LayerShape(kv_heads, dim)], num_blocks, block_size, dtype, torch.device("cpu"), kv_dtype
        )
        table = torch.randperm(num_blocks, generator=generator)
        self.slots = (table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:length]
        keys = torch.randn(length, kv_heads, dim, generator=generator) * 3  # [ctx, KVH, D]
        values = torch.randn(length, kv_heads, dim, generator=generator)
        self.cache.write(0, self.slots, keys.to(dtype), values.to(dtype))
        self.q = torch.randn(1, heads, num_new, dim, generator=generator).to(dtype)
        self.k_new = keys[num_computed:].transpose(0, 1).unsqueeze(0).to(dtype)  # [1, KVH, n, D]
        self.v_new = values[num_computed:].transpose(0, 1).unsqueeze(0).to(dtype)
        self.num_computed, self.num_new = num_computed, num_new

    def attend(self, window=None, softcap=None, scaling=0.125) -> torch.Tensor:
        return attend_chunk(
            self.q, self.k_new, self.v_new, self.cache, 0, self.slots, self.num_computed, scaling, window, softcap
        )

    def expected(self, window=None, softcap=None, scaling=0.125) -> torch.Tensor:
        """float64 attention over the cache's prefix and the fresh rows → [n, H, D]."""
        stored_keys, stored_values = self.cache.read(0, self.slots[: self.num_computed])  # [P, KVH, D]
        keys = torch.cat([stored_keys.double(), self.k_new[0].transpose(0, 1).double()])  # [ctx, KVH, D]
        values = torch.cat([stored_values.double(), self.v_new[0].transpose(0, 1).double()])
        groups = self.q.shape[1] // keys.shape[1]
        keys, values = (t.transpose(0, 1).repeat_interleave(groups, dim=0) for t in (keys, values))  # [H, ctx, D]
        scores = self.q[0].double() @ keys.transpose(-1, -2) * scaling  # [H, n, ctx]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        mask = prefill_mask(self.num_new, self.num_computed, window, torch.device("cpu"))  # [n, ctx]
        out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ values  # [H, n, D]
        return out.transpose(0, 1)


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return (out.double() - expected).abs().max().item()


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize(("num_computed", "num_new"), [(0, 37), (1, 40), (300, 77), (1000, 129)])
def test_a_chunk_over_its_prefix_equals_float64_math(kv_dtype, heads, kv_heads, num_computed, num_new):
    chunk = Chunk(heads, kv_heads, 32, num_computed, num_new, kv_dtype, seed=num_computed + heads)
    out = chunk.attend()
    assert out.shape == (num_new, heads, 32)
    assert max_error(out, chunk.expected()) < TOLERANCE


@pytest.mark.parametrize(("window", "softcap"), [(50, None), (None, 20.0), (64, 30.0)])
def test_windowed_and_softcapped_chunks_take_the_masked_path_and_agree(window, softcap):
    chunk = Chunk(6, 2, 16, 500, 90, torch.int8, seed=3)
    assert max_error(chunk.attend(window, softcap), chunk.expected(window, softcap)) < TOLERANCE


def test_a_bf16_chunk_over_its_prefix():
    chunk = Chunk(8, 2, 64, 700, 100, torch.bfloat16, dtype=torch.bfloat16, seed=5)
    out = chunk.attend()
    assert out.dtype == torch.bfloat16
    assert max_error(out, chunk.expected()) < BF16_TOLERANCE


def test_the_prefix_decides_the_output():
    """A test that can fail: the same chunk over another prefix gives another output."""
    first, second = Chunk(4, 2, 32, 200, 50, torch.float32, seed=1), Chunk(4, 2, 32, 200, 50, torch.float32, seed=1)
    second.cache.write(0, second.slots[:10], torch.randn(10, 2, 32) * 5, torch.randn(10, 2, 32))
    assert max_error(first.attend(), second.attend().double()) > 1e-3


def largest_allocation(chunk: Chunk, window=None) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        chunk.attend(window)
    return max(event.cpu_memory_usage for event in prof.events())


def test_a_late_chunk_allocates_nothing_of_chunk_by_context_size():
    """The split path holds tiles, the prefix's K/V and the chunk's rows, never an [n, ctx] matrix
    (a boolean mask would be n * ctx bytes; the masked path's float copy of it four times that)."""
    chunk = Chunk(4, 2, 32, 1536, 512, torch.int8)
    matrix_bytes = chunk.num_new * (chunk.num_computed + chunk.num_new)
    assert largest_allocation(chunk) < matrix_bytes
    assert largest_allocation(chunk, window=100_000) >= matrix_bytes  # the masked path does (the check sees it)
