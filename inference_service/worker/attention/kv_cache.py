"""The KV cache tensors: per layer one K and one V tensor of `num_blocks * block_size` slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerShape:
    num_kv_heads: int
    head_dim: int


class PagedKVCache:
    """Slot-addressed K/V storage; `KVCacheManager` decides which request owns which block.

    Zero-initialised: masked-out slots still enter the attention matmul, and garbage NaNs there
    would poison the output even with a zero weight.
    """

    def __init__(
        self, layer_shapes: list[LayerShape], num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        num_slots = num_blocks * block_size
        self.keys = [
            torch.zeros(num_slots, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for s in layer_shapes
        ]  # each [num_slots, KVH, D]
        self.values = [
            torch.zeros(num_slots, s.num_kv_heads, s.head_dim, dtype=dtype, device=device) for s in layer_shapes
        ]

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer_idx], self.values[layer_idx]

    @staticmethod
    def bytes_per_token(layer_shapes: list[LayerShape], dtype: torch.dtype) -> int:
        element_size = torch.empty((), dtype=dtype).element_size()
        return sum(2 * s.num_kv_heads * s.head_dim * element_size for s in layer_shapes)
