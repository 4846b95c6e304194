"""Which quantization scheme serves a model: `--quantize` (TGI's values, and ours: gguf) against what
the checkpoint's `config.json` says (`quantization_config`), as TGI decides it.

A pre-quantized checkpoint needs no flag; a flag that contradicts it is an error, and so is a flag
naming a checkpoint format (gptq, awq, compressed-tensors) for a checkpoint that isn't one. The
other schemes quantize a full-precision checkpoint while it loads.
"""

from __future__ import annotations

from typing import Any

from inference_service.errors import ModelLoadError

# Quantized while loading a full-precision checkpoint.
AT_LOAD = ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "eetq", "fp8")
# Read from a checkpoint already in that format.
CHECKPOINT_FORMATS = ("gptq", "awq", "compressed-tensors")
# GGUF files keep their quantized tensors instead of being dequantized.
GGUF = "gguf"


def checkpoint_scheme(quantization_config: dict[str, Any] | None) -> str | None:
    """The scheme a checkpoint is stored in, from its `quantization_config`; None when unquantized."""
    if not quantization_config:
        return None
    method = str(quantization_config.get("quant_method", "")).lower()
    if method in ("gptq", "awq", "compressed-tensors"):
        return method
    if method == "bitsandbytes":
        if quantization_config.get("load_in_4bit"):
            return "bitsandbytes-fp4" if quantization_config.get("bnb_4bit_quant_type") == "fp4" else "bitsandbytes-nf4"
        return "bitsandbytes"
    if method == "fp8":
        return "fp8"
    raise ModelLoadError(
        f"the checkpoint is quantized with {method or 'an unnamed method'!r}, which this server "
        f"can't read; supported checkpoint formats: {', '.join(CHECKPOINT_FORMATS)}"
    )


def resolve_scheme(flag: str | None, stored: str | None, *, is_gguf: bool) -> str | None:
    """The scheme to serve with, or None for full precision; a contradiction is a `ModelLoadError`."""
    if flag == GGUF and not is_gguf:
        raise ModelLoadError(
            "--quantize gguf keeps a GGUF file's quantized tensors: the model id must be a "
            ".gguf file (or the demo model)"
        )
    if stored in CHECKPOINT_FORMATS:
        if flag not in (None, stored):
            raise ModelLoadError(
                f"the checkpoint is already quantized with {stored}; --quantize {flag} "
                f"contradicts it (drop the flag, or pass --quantize {stored})"
            )
        return stored
    if stored is not None:  # bitsandbytes or fp8 serialized: TGI re-quantizes from full precision only
        raise ModelLoadError(
            f"the checkpoint holds {stored} weights, which are only made while loading; "
            "serve the full-precision checkpoint with --quantize " + stored
        )
    if flag in CHECKPOINT_FORMATS:
        raise ModelLoadError(
            f"--quantize {flag} reads a checkpoint stored in that format, and this one is not "
            f"quantized; to quantize while loading use one of {', '.join(AT_LOAD)}"
        )
    return flag
