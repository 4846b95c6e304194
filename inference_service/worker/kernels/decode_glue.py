"""Which native decode-step glue (norms, rotary and KV write, SiLU-mul) a device and dtype get: fp32's
from bindings, bf16's from bf16_glue; None means the torch ops."""

from __future__ import annotations

import torch

from inference_service.worker.kernels import bindings
from inference_service.worker.kernels.bf16_glue import BF16DecodeGlue, load_bf16_decode_glue


def decode_glue_for(device: torch.device, dtype: torch.dtype) -> bindings.DecodeGlue | BF16DecodeGlue | None:
    """The native decode-step ops where they apply (fp32 or bf16 on CPU) and build; None: torch ops."""
    if device.type == "cpu" and dtype == torch.bfloat16 and not bindings._switched_off():
        return load_bf16_decode_glue()
    library = bindings._library_for(device, dtype)
    return bindings.DecodeGlue(library) if library is not None else None
