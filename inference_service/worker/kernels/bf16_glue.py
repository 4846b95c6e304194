"""The ops between a bfloat16 model's decode-step projections, native (csrc/bf16_glue.cpp): one call
each, rounding where transformers' bf16 modules round. bindings.DecodeGlue over the `_bf16` symbols,
so runner/decode_step.py runs either; the KV rows go straight into a bf16 cache."""

from __future__ import annotations

import torch

from inference_service.worker.kernels import bindings


class BF16DecodeGlue(bindings.DecodeGlue):
    """add_rms_norm (the residual rounded to bf16), rope_kv_write and silu_mul over bf16 rows."""

    cache_dtype = torch.bfloat16
    symbol_suffix = "bf16"


def load_bf16_decode_glue() -> BF16DecodeGlue | None:
    library = bindings.load_library()
    return BF16DecodeGlue(library) if library is not None else None
