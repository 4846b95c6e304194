"""Bindings of the ops between an fp32 model's decode-step projections (csrc/decode_glue.cpp): residual
add + RMSNorm, Q/K norm + rotary + KV write, SiLU·mul, one call each (kernels/bf16_glue.py: bf16's)."""

from __future__ import annotations

import ctypes

import torch

from inference_service.worker.kernels import native_build
from inference_service.worker.kernels.native_build import F32, I64, POINTER, pointer


class DecodeGlue:
    """The ops between a decode step's projections (see csrc/decode_glue.cpp); fp32, contiguous.
    Subclasses for other dtypes name their symbols' suffix and their dtype (kernels/bf16_glue.py)."""

    cache_dtype = torch.float32  # the rows' dtype, and the KV cache dtype rope_kv_write writes into
    symbol_suffix = "f32"

    def __init__(self, library: ctypes.CDLL):
        suffix = self.symbol_suffix
        self._norm = native_build.bind(library, f"add_rms_norm_{suffix}", [POINTER] * 4 + [I64] * 2 + [F32])
        self._rope = native_build.bind(
            library, f"rope_kv_write_{suffix}", [POINTER] * 5 + [F32] + [POINTER] * 3 + [I64] * 4
        )
        self._silu_mul = native_build.bind(library, f"silu_mul_{suffix}", [POINTER] * 2 + [I64] * 2)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden [S, D] += delta (in place), then weight * rmsnorm(hidden) → new [S, D]."""
        out = torch.empty_like(hidden)
        self._norm(
            hidden.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            hidden.shape[0],
            hidden.shape[1],
            eps,
        )
        return out

    def rope_kv_write(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        key_cache: torch.Tensor | None,
        value_cache: torch.Tensor | None,
        slots: torch.Tensor,
        heads: int,
        kv_heads: int,
    ) -> None:
        """qkv [S, H + 2 KVH, Dh]: q, k normed (if given) and rotated in place; k, v into the cache
        (of `cache_dtype`), unless the caches are None."""
        cos, sin = cos.to(self.cache_dtype).contiguous(), sin.to(self.cache_dtype).contiguous()
        status = self._rope(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps,
            pointer(key_cache),
            pointer(value_cache),
            slots.data_ptr(),
            qkv.shape[0],
            heads,
            kv_heads,
            qkv.shape[-1],
        )
        if status != 0:
            raise RuntimeError(f"rotary kernel refused head size {qkv.shape[-1]}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [S, 2 I] → silu(gate) * up [S, I]."""
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out
