"""All decoder layers of a bfloat16 model's decode step in one native call (csrc/bf16_layers.cpp):
the same kernels as the op-by-op plan, in the same order, without a Python call between them."""

from __future__ import annotations

import ctypes

import torch

from inference_service.worker.kernels import bindings
from inference_service.worker.kernels.decode_layers import step_args

_POINTER, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# A layer's entries in the table (csrc/bf16_layers.cpp's Field, in its order).
FIELDS = (
    "input_norm",
    "post_norm",
    "qkv",
    "qkv_bias",
    "o",
    "o_bias",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
    "q_norm",
    "k_norm",
    "key_cache",
    "value_cache",
    "window",
)


class BF16Layers:
    """`run(table, hidden, ...)`: hidden [S, D] bf16 through every layer of `table` [L, len(FIELDS)]."""

    def __init__(self, library: ctypes.CDLL):
        self._fn = bindings._bind(
            library, "bf16_decode_layers", [_POINTER, _I64] + [_POINTER] * 6 + [_I64] * 8 + [_F32] * 3
        )

    def run(
        self,
        table: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        block_table: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        shape: tuple[int, int, int, int],
        norm_eps: float,
        qk_eps: float,
        scale: float,
    ) -> None:
        """hidden [S, D] in place; cos, sin [S, Dh] bf16; slots [S], block_table [S, NB] and context_lens
        [S] int64; shape (heads, KV heads, head size, MLP width); all contiguous."""
        args = step_args(table, hidden, cos, sin, slots, block_table, context_lens, block_size, shape)
        status = self._fn(*args, norm_eps, qk_eps, scale)
        if status != 0:
            heads, kv_heads, head_dim, _ = shape
            raise RuntimeError(f"fused bf16 layers refused {heads} heads over {kv_heads} KV heads of size {head_dim}")


def load_bf16_layers() -> BF16Layers | None:
    library = bindings.load_library()
    return BF16Layers(library) if library is not None else None
