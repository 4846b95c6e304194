"""The ops between a bfloat16 model's decode-step projections, native (csrc/bf16_glue.cpp): one call
each, rounding where transformers' bf16 modules round. Same interface as bindings.DecodeGlue, so
runner/decode_step.py runs either; the KV rows go straight into a bf16 cache."""

from __future__ import annotations

import ctypes

import torch

from inference_service.worker.kernels import bindings


class BF16DecodeGlue:
    """add_rms_norm, rope_kv_write and silu_mul over bf16 rows (contiguous), as DecodeGlue's over fp32."""

    cache_dtype = torch.bfloat16  # the KV cache dtype rope_kv_write writes into directly

    def __init__(self, library: ctypes.CDLL):
        pointer, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        self._norm = bindings._bind(library, "add_rms_norm_bf16", [pointer] * 4 + [i64] * 2 + [f32])
        self._rope = bindings._bind(library, "rope_kv_write_bf16", [pointer] * 5 + [f32] + [pointer] * 3 + [i64] * 4)
        self._silu_mul = bindings._bind(library, "silu_mul_bf16", [pointer] * 2 + [i64] * 2)

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """hidden [S, D] += delta (in place, rounded to bf16), then weight * rmsnorm(hidden) → new [S, D]."""
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
        """qkv [S, H + 2 KVH, Dh] bf16: q, k normed (if given) and rotated in place; k, v into the bf16
        cache, unless the caches are None."""
        cos, sin = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
        status = self._rope(
            qkv.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            None if q_norm is None else q_norm.data_ptr(),
            None if k_norm is None else k_norm.data_ptr(),
            eps,
            bindings._pointer(key_cache),
            bindings._pointer(value_cache),
            slots.data_ptr(),
            qkv.shape[0],
            heads,
            kv_heads,
            qkv.shape[-1],
        )
        if status != 0:
            raise RuntimeError(f"rotary kernel refused head size {qkv.shape[-1]}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [S, 2 I] → silu(gate) * up [S, I], bf16."""
        rows, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, width)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)
        return out


def load_bf16_decode_glue() -> BF16DecodeGlue | None:
    library = bindings.load_library()
    return BF16DecodeGlue(library) if library is not None else None
