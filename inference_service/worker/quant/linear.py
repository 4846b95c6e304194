"""Placeholder until the native kernel lands: a linear over a PackedWeight, by dequantizing."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_service.worker.quant.packed import PackedWeight


class QuantLinear(torch.nn.Module):
    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None,
                 input_perm: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        self.register_buffer("input_perm", input_perm)
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.register_buffer("bias", bias)

    @classmethod
    def from_packed(cls, packed: PackedWeight, bias: torch.Tensor | None = None,
                    input_perm: torch.Tensor | None = None) -> QuantLinear:
        return cls(packed, bias, input_perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_perm is not None:
            x = x[..., self.input_perm]
        return F.linear(x, self.packed.dequantize().to(x.dtype), self.bias)
