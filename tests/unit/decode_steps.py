"""Decode steps for the fused-layer tests (test_bf16_layers.py, test_fused_layers.py): a paged cache
holding earlier tokens' K/V, one new token per sequence over shuffled blocks with ragged context
lengths, and a counter of the fused kernel's calls."""

from __future__ import annotations

import torch

from inference_service.worker.attention.kv_cache import LayerShape, PagedKVCache
from inference_service.worker.attention.step_metadata import StepMetadata
from inference_service.worker.kernels import bindings
from inference_service.worker.runner.decode_step import DecodeStep

BLOCK_SIZE = 4
NUM_BLOCKS = 64


def cache_for(step: DecodeStep, dtype: torch.dtype, kv_dtype: torch.dtype) -> PagedKVCache:
    """A cache of `kv_dtype` (with the native writer) holding random earlier rows (int8: and scales)."""
    shapes = [LayerShape(layer.num_kv_heads, layer.head_dim) for layer in step.layers]
    cpu = torch.device("cpu")
    cache = PagedKVCache(
        shapes, NUM_BLOCKS, BLOCK_SIZE, dtype, cpu, kv_dtype=kv_dtype, writer=bindings.load_kv_writer()
    )
    generator = torch.Generator().manual_seed(3)
    for stored in cache.keys + cache.values:  # earlier tokens' K/V
        values = torch.randn(stored.shape, generator=generator)
        stored.copy_((values * 40).round().clamp(-127, 127) if kv_dtype == torch.int8 else values)
    for scales in (cache.key_scales or []) + (cache.value_scales or []):
        scales.copy_(torch.rand(scales.shape, generator=generator) / 40)
    return cache


def meta(cache: PagedKVCache, context_lens: list[int]) -> StepMetadata:
    """A decode step of one new token per sequence, its blocks drawn shuffled from the pool."""
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
    width = max(-(-n // BLOCK_SIZE) for n in context_lens)
    table = torch.zeros(len(context_lens), width, dtype=torch.int64)
    for row, n in enumerate(context_lens):
        for column in range(-(-n // BLOCK_SIZE)):
            table[row, column] = blocks.pop()
    slots = torch.tensor(
        [
            int(table[row, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
            for row, n in enumerate(context_lens)
        ]
    )
    return StepMetadata(
        kv_cache=cache,
        num_tokens=len(context_lens),
        slot_mapping=slots,
        decode_block_table=table,
        decode_context_lens=torch.tensor(context_lens),
        decode_only=True,
        decode_kernel=bindings.load_paged_decode(),
    )


def forward(step: DecodeStep, cache: PagedKVCache, context_lens: list[int]) -> torch.Tensor:
    ids = torch.arange(3, 3 + len(context_lens)).unsqueeze(0) * 7
    positions = torch.tensor(context_lens).unsqueeze(0) - 1
    with torch.inference_mode():
        return step.forward(meta(cache, context_lens), ids, positions, list(range(len(context_lens))))


class CountingRuns:
    """Stands in for a fused call's kernel, counting its runs."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, 0

    def run(self, *args, **kwargs):
        self.calls += 1
        return self.kernel.run(*args, **kwargs)


def counted(step: DecodeStep) -> CountingRuns:
    """The step's fused call, its kernel's runs counted from now."""
    assert step.fused is not None
    counting = CountingRuns(step.fused.kernel)
    step.fused.kernel = counting  # type: ignore[assignment]
    return counting


def assert_same_caches(ours: PagedKVCache, theirs: PagedKVCache) -> None:
    """The two caches hold bitwise the same K/V rows (and int8 scales)."""
    for mine, other in zip(ours.keys + ours.values, theirs.keys + theirs.values, strict=True):
        assert torch.equal(mine, other), "the new K/V rows differ"
    for mine, other in zip(
        (ours.key_scales or []) + (ours.value_scales or []),
        (theirs.key_scales or []) + (theirs.value_scales or []),
        strict=True,
    ):
        assert torch.equal(mine, other), "the new int8 scales differ"
