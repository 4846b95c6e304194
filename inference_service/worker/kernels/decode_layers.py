"""All decoder layers of an fp32 model's decode step in one native call (csrc/decode_layers.cpp), LoRA
updates included: the same kernels as the op-by-op plan, in the same order, without Python between."""

from __future__ import annotations

import ctypes

import torch

from inference_service.worker.kernels import native_build
from inference_service.worker.kernels.native_build import F32, I64, POINTER

# A layer's words in the table (csrc/decode_layers.cpp's Layer, in its order): its own, then each
# projection's (Projection) prefixed by the projection's name.
LAYER_FIELDS = (
    "input_norm",
    "post_norm",
    "q_norm",
    "k_norm",
    "key_cache",
    "value_cache",
    "key_scales",
    "value_scales",
    "window",
)
PROJECTIONS = ("qkv", "o", "gate_up", "down")
PROJECTION_FIELDS = (
    "kind",
    "few_rows",
    "weight",
    "scales",
    "offsets",
    "wide_scales",
    "wide_offsets",
    "bias",
    "n",
    "k",
    "bits",
    "group_size",
    "max_rows",
    "lora_parts",
    "lora_count",
)
FIELDS = LAYER_FIELDS + tuple(f"{p}.{f}" for p in PROJECTIONS for f in PROJECTION_FIELDS)
# Projection kinds: fp32 panels, packed codes (few-rows kernel, else the panel GEMM), 8-bit code panels.
PANELS, PACKED, CODE_PANELS = range(3)
# The step's LoRA plan (csrc/decode_layers.cpp's Lora, in its order).
LORA_FIELDS = ("single", "sgmv", "bgmv", "panel_row", "table", "table_len", "rows", "groups", "num_groups", "max_rank")


def step_args(
    table: torch.Tensor,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    shape: tuple[int, int, int, int],
) -> tuple[int, ...]:
    """The arguments the fused calls (fp32 and bf16) take first, in their order."""
    return (
        table.data_ptr(),
        table.shape[0],
        hidden.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.data_ptr(),
        block_table.data_ptr(),
        context_lens.data_ptr(),
        hidden.shape[0],
        block_table.shape[1],
        block_size,
        hidden.shape[1],
        *shape,
    )


class FP32Layers:
    """`run(table, hidden, ...)`: hidden [S, D] fp32 through every layer of `table` [L, len(FIELDS)]."""

    def __init__(self, library: ctypes.CDLL):
        words = native_build.bind(library, "fp32_decode_layer_words", [])
        lora_words = native_build.bind(library, "fp32_decode_lora_words", [])
        if (words(), lora_words()) != (len(FIELDS), len(LORA_FIELDS)):
            raise RuntimeError("csrc/decode_layers.cpp's tables differ from kernels/decode_layers.py's fields")
        self._fn = native_build.bind(
            library, "fp32_decode_layers", [POINTER, I64] + [POINTER] * 6 + [I64] * 9 + [F32] * 3 + [POINTER]
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
        kv_dtype: int,
        eps: tuple[float, float],
        scale: float,
        lora: torch.Tensor | None,
    ) -> None:
        """hidden [S, D] in place; cos, sin [S, Dh] fp32; slots [S], block_table [S, NB] and context_lens
        [S] int64; shape (heads, KV heads, head size, MLP width); kv_dtype a KV_DTYPE_CODES value; eps
        the norms' and the Q/K norms'; lora the step's LORA_FIELDS (int64) or None; all contiguous."""
        args = step_args(table, hidden, cos, sin, slots, block_table, context_lens, block_size, shape)
        status = self._fn(*args, kv_dtype, *eps, scale, None if lora is None else lora.data_ptr())
        if status != 0:
            raise RuntimeError(f"fused fp32 layers refused a step of {hidden.shape[0]} rows")


def load_fp32_layers() -> FP32Layers | None:
    library = native_build.load_library()
    return FP32Layers(library) if library is not None else None
