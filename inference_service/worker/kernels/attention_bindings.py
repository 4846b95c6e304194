"""Bindings of the native decode attention over the paged KV cache (csrc/paged_decode.cpp) and of
the conversion of new K/V rows into the cache's dtype (csrc/kv_write.cpp)."""

from __future__ import annotations

import ctypes
import functools

import torch

from inference_service.worker.kernels import native_build
from inference_service.worker.kernels.native_build import F32, I64, POINTER, pointer

MAX_GROUPS = 8  # query heads per KV head that the attention kernel is instantiated for
# The KV cache element types the kernels read and write (csrc/kv_types.h's KVDtype).
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}


class PagedDecodeKernel:
    """Decode attention reading the paged cache in place: q [S, H, D] fp32 → out [S, H, Dv] fp32,
    the cache in any of KV_DTYPE_CODES' dtypes (int8 with its scales).

    Unlike torch's indexing, the kernel does not bounds-check: it trusts that each sequence's
    table covers its context. ModelRunner indexes the table at every decode's last position, so a
    short table raises there first, and block ids come from the block manager's own pool.
    """

    def __init__(self, library: ctypes.CDLL):
        self._fn = native_build.bind(library, "paged_decode", [POINTER] * 8 + [I64] * 7 + [F32, I64, F32, I64])

    def supports(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
        """Whether the kernel computes this call (q [S, H, D]); otherwise the torch path does."""
        return (
            q.dtype == torch.float32
            and key_cache.dtype == value_cache.dtype
            and key_cache.dtype in KV_DTYPE_CODES
            and q.device.type == "cpu"
            and key_cache.is_contiguous()
            and value_cache.is_contiguous()
            and self._supports_shapes(q.shape[-2], key_cache.shape[1], key_cache.shape[2], value_cache.shape[2])
        )

    @staticmethod
    @functools.cache
    def _supports_shapes(num_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int) -> bool:
        return (
            num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUPS
            and head_dim % 8 == 0
            and head_dim_v % 8 == 0
        )

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        window: int | None,
        softcap: float | None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`scales`: the K and V scales ([slots, KVH] fp32, contiguous) of an int8 cache."""
        q = q.contiguous()
        if block_table.dtype != torch.int64 or not block_table.is_contiguous():
            block_table = block_table.to(torch.int64).contiguous()
        if context_lens.dtype != torch.int64 or not context_lens.is_contiguous():
            context_lens = context_lens.to(torch.int64).contiguous()
        num_seqs, num_heads, head_dim = q.shape
        out = q.new_empty(num_seqs, num_heads, value_cache.shape[2])
        key_scales, value_scales = scales if scales is not None else (None, None)
        status = self._fn(
            q.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            pointer(key_scales),
            pointer(value_scales),
            block_table.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            num_seqs,
            num_heads,
            key_cache.shape[1],
            head_dim,
            value_cache.shape[2],
            block_size,
            block_table.shape[1],
            scale,
            window or 0,
            softcap or 0.0,
            KV_DTYPE_CODES[key_cache.dtype],
        )
        if status != 0:
            raise RuntimeError(
                f"paged decode kernel refused {num_heads} heads over {key_cache.shape[1]} KV heads "
                f"in a {key_cache.dtype} cache"
            )
        return out


class KVWriter:
    """New K/V rows (fp32, rows of a wider tensor) into the paged cache, converted to its dtype."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = native_build.bind(library, "kv_write", [POINTER, I64, POINTER, I64] + [POINTER] * 5 + [I64] * 5)

    def __call__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scales: tuple[torch.Tensor, torch.Tensor] | None,
        slots: torch.Tensor,
    ) -> None:
        """keys [S, KVH, D], values [S, KVH, Dv] fp32, each row's heads contiguous (row stride free);
        slots [S] int64 contiguous."""
        if not (self.takes(keys) and self.takes(values)):
            raise ValueError("K/V rows must be fp32 on the CPU with each row's heads contiguous")
        key_scales, value_scales = scales if scales is not None else (None, None)
        status = self._fn(
            keys.data_ptr(),
            keys.stride(0),
            values.data_ptr(),
            values.stride(0),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            pointer(key_scales),
            pointer(value_scales),
            slots.data_ptr(),
            keys.shape[0],
            keys.shape[1],
            keys.shape[2],
            values.shape[2],
            KV_DTYPE_CODES[key_cache.dtype],
        )
        if status != 0:
            raise RuntimeError(f"KV write kernel refused a {key_cache.dtype} cache")

    @staticmethod
    def takes(rows: torch.Tensor) -> bool:
        """Whether rows [S, KVH, D] are in the layout the kernel reads."""
        return (
            rows.dtype == torch.float32
            and rows.device.type == "cpu"
            and rows.stride(2) == 1
            and rows.stride(1) == rows.shape[2]
        )
