"""Quantizing a full-precision model's linears while it loads: `--quantize eetq | fp8 | bitsandbytes*`.

- eetq: int8 weight-only with per-channel scales, into our packed layout and native kernel.
- fp8: e4m3 weights with per-channel scales. No CPU has an fp8 matmul, so the rounded weights run
  dequantized (the accuracy of fp8, the speed and memory of fp32); the log says so.
- bitsandbytes (LLM.int8 with its outlier threshold), bitsandbytes-nf4, bitsandbytes-fp4: the
  bitsandbytes library's own modules and CPU kernels (nf4 and fp4 are codebooks, not affine codes).

Every `nn.Linear` is quantized, the output head included (it is the largest matrix of a small
model, and decode reads it every step); embeddings, norms and biases stay in full precision.
"""

from __future__ import annotations

import logging
from typing import cast

import torch

from inference_service.errors import ModelLoadError
from inference_service.worker.kernels.packed import quantize_rtn
from inference_service.worker.linears.quant import QuantLinear
from inference_service.worker.linears.replace import replace_module

logger = logging.getLogger(__name__)

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_at_load(model: torch.nn.Module, scheme: str) -> int:
    """Replace the model's linears in place for `scheme`; returns how many were quantized."""
    make = {
        "eetq": _eetq,
        "fp8": _fp8,
        "bitsandbytes": _bnb_int8,
        "bitsandbytes-nf4": lambda linear: _bnb_4bit(linear, "nf4"),
        "bitsandbytes-fp4": lambda linear: _bnb_4bit(linear, "fp4"),
    }[scheme]
    if scheme == "fp8":
        logger.warning(
            "--quantize fp8: this device has no fp8 matmul; weights are rounded to e4m3 with "
            "per-channel scales and run dequantized"
        )
    names = [name for name, module in model.named_modules() if type(module) is torch.nn.Linear]
    for name in names:
        replace_module(model, name, make(model.get_submodule(name)))
    return len(names)


def float_bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach().float().contiguous()


def _eetq(linear: torch.nn.Linear) -> torch.nn.Module:
    weight = linear.weight.detach().float()  # [N, K]
    return QuantLinear.from_packed(
        quantize_rtn(weight, bits=8, group_size=weight.shape[1], symmetric=True), float_bias(linear)
    )


def _fp8(linear: torch.nn.Linear) -> torch.nn.Module:
    weight = linear.weight.detach().float()  # [N, K]
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX  # [N, 1]
    rounded = (weight / scale).to(torch.float8_e4m3fn).float() * scale
    with torch.no_grad():
        linear.weight.copy_(rounded.to(linear.weight.dtype))
    return linear


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError:
        raise ModelLoadError(
            "--quantize bitsandbytes* needs the bitsandbytes package: pip install 'inference-service[quantize]'"
        ) from None
    return bitsandbytes


def _bnb_int8(linear: torch.nn.Linear) -> torch.nn.Module:
    bnb = _bitsandbytes()
    module = bnb.nn.Linear8bitLt(
        linear.in_features, linear.out_features, bias=linear.bias is not None, has_fp16_weights=False, threshold=6.0
    )
    module.weight = bnb.nn.Int8Params(linear.weight.detach().float(), requires_grad=False, has_fp16_weights=False)
    if linear.bias is not None:
        module.bias = torch.nn.Parameter(cast(torch.Tensor, float_bias(linear)), requires_grad=False)  # has a bias
    return module.to(linear.weight.device)  # the move is what quantizes


def _bnb_4bit(linear: torch.nn.Linear, quant_type: str) -> torch.nn.Module:
    bnb = _bitsandbytes()
    module = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        quant_type=quant_type,
        compute_dtype=linear.weight.dtype,
    )
    module.weight = bnb.nn.Params4bit(linear.weight.detach().float(), requires_grad=False, quant_type=quant_type)
    if linear.bias is not None:
        module.bias = torch.nn.Parameter(cast(torch.Tensor, float_bias(linear)), requires_grad=False)  # has a bias
    return module.to(linear.weight.device)


def weights_nbytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (QuantLinear's packed codes included), each tensor once."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total
