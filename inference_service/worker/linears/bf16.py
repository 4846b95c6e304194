"""Routes a bfloat16 model's few-row projections (decode steps) through the native bf16 kernel.

torch's bf16 GEMM on CPU is slow at a few rows (see csrc/bf16_linear.cpp), where a decode step
spends its time. `install` switches the class of each plain bf16 `nn.Linear` the kernel takes to
`BF16NativeLinear`: same parameters (tied weights stay tied), same state dict; many rows, and a
product that needs autograd, still go to torch's GEMM.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from inference_service.worker.kernels.bindings import MAX_BF16_LINEAR_ROWS, BF16Linear

KERNELS = ("bf16_kernel",)  # the instance attributes install() sets


class BF16NativeLinear(torch.nn.Linear):
    """An `nn.Linear` whose forward sends at most MAX_BF16_LINEAR_ROWS bf16 rows to the native kernel."""

    bf16_kernel: BF16Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few_rows = x.numel() <= MAX_BF16_LINEAR_ROWS * self.in_features
        if x.dtype == torch.bfloat16 and few_rows and not torch.is_grad_enabled():
            return self.bf16_kernel(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def install(model: torch.nn.Module, kernel: BF16Linear) -> int:
    """Switch the model's eligible linears to BF16NativeLinear; returns how many were switched."""
    switched = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or not kernel.supports_weight(module.weight):
            continue
        bias = module.bias
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            continue
        module.__class__ = BF16NativeLinear
        cast(BF16NativeLinear, module).bf16_kernel = kernel  # the same object, now of the class just set
        switched += 1
    return switched
