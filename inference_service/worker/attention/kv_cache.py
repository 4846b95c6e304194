"""The KV cache tensors: per layer one K and one V tensor of `num_blocks * block_size` slots.

The cache's element type (`--kv-cache-dtype`) is its own, apart from the model's: rows are converted
as they are written and read in place by the decode kernel (kernels/csrc/kv_types.h). int8 keeps
one fp32 scale per token and KV head (absmax / 127) beside the codes: a block's rows are written
one step at a time, so a scale per block would have to be fixed before its largest value arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inference_service.worker.kernels.bindings import KVWriter

# --kv-cache-dtype values → the storage dtype ("auto": the model's). Aliases are torch's names.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
}
SCALE_BYTES = 4  # one fp32 scale per token and KV head, int8 only


def resolve_kv_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype for a --kv-cache-dtype value (None or "auto": the model's dtype)."""
    if name is None:
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


@dataclass(frozen=True)
class LayerShape:
    num_kv_heads: int
    head_dim: int


class PagedKVCache:
    """Slot-addressed K/V storage; `KVCacheManager` decides which request owns which block.

    Zero-initialised: masked-out slots still enter the attention matmul, and garbage NaNs there
    would poison the output even with a zero weight. `dtype` is the model's (what reads return);
    `kv_dtype` what the cache stores (default: the model's).
    """

    def __init__(
        self,
        layer_shapes: list[LayerShape],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
        writer: KVWriter | None = None,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype
        self.writer = writer  # native conversion of fp32 rows (decode steps); None: torch ops
        num_slots = num_blocks * block_size

        def tensors(dtype: torch.dtype, with_dim: bool) -> list[torch.Tensor]:
            return [
                torch.zeros(num_slots, s.num_kv_heads, *((s.head_dim,) if with_dim else ()), dtype=dtype, device=device)
                for s in layer_shapes
            ]

        self.keys = tensors(self.kv_dtype, True)  # each [num_slots, KVH, D]
        self.values = tensors(self.kv_dtype, True)
        self.quantized = self.kv_dtype == torch.int8
        # each [num_slots, KVH] fp32 (int8 only)
        self.key_scales = tensors(torch.float32, False) if self.quantized else None
        self.value_scales = tensors(torch.float32, False) if self.quantized else None

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's stored K and V ([num_slots, KVH, D], in `kv_dtype`)."""
        return self.keys[layer_idx], self.values[layer_idx]

    def scales(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's int8 scales ([num_slots, KVH] fp32 each); None where the cache holds floats."""
        if self.key_scales is None or self.value_scales is None:
            return None
        return self.key_scales[layer_idx], self.value_scales[layer_idx]

    def write(self, layer_idx: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values [T, KVH, D] (model dtype) → the cache at `slots` [T], converted."""
        if self.writer is not None and self.writer.takes(keys) and self.writer.takes(values):
            keys_out, values_out = self.layer(layer_idx)
            self.writer(keys, values, keys_out, values_out, self.scales(layer_idx), slots)
            return
        if not self.quantized:
            self.keys[layer_idx].index_copy_(0, slots, keys.to(self.kv_dtype))
            self.values[layer_idx].index_copy_(0, slots, values.to(self.kv_dtype))
            return
        scales = self.scales(layer_idx)
        assert scales is not None
        for cache, scale_cache, rows in zip(self.layer(layer_idx), scales, (keys, values), strict=True):
            codes, scale = quantize_int8(rows)
            cache.index_copy_(0, slots, codes)
            scale_cache.index_copy_(0, slots, scale)

    def read(self, layer_idx: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `slots` [n] → [n, KVH, D] each, in the model's dtype (a copy)."""
        scales = self.scales(layer_idx) or (None, None)
        keys, values = (
            widen(stored.index_select(0, slots), None if scale is None else scale.index_select(0, slots), self.dtype)
            for stored, scale in zip(self.layer(layer_idx), scales, strict=True)
        )
        return keys, values

    @staticmethod
    def bytes_per_token(layer_shapes: list[LayerShape], dtype: torch.dtype) -> int:
        """Bytes one token takes in every layer's K and V, stored as `dtype` (int8: scales counted)."""
        element_size = torch.empty((), dtype=dtype).element_size()
        scale_bytes = SCALE_BYTES if dtype == torch.int8 else 0
        return sum(2 * s.num_kv_heads * (s.head_dim * element_size + scale_bytes) for s in layer_shapes)


def quantize_int8(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., D] → int8 codes [..., D] and fp32 scales [...]: absmax / 127 per row."""
    rows = rows.float()
    scale = rows.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(rows / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def widen(stored: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored K or V [..., D] (with their int8 scales [...]) → `dtype`."""
    if scales is None:
        return stored.to(dtype)
    return (stored.float() * scales[..., None]).to(dtype)
